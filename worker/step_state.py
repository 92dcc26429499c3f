"""What a step carries between the runner's three calls: the inputs planned on the host
(StepInputs), the prompt tokens whose logprobs it yields (PromptPlan), and a launched step
whose tokens the device is still producing (InFlight)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.engine import Logprobs
from protocol.worker import PromptLogprobs
from worker.attention import AttentionMetadata
from worker.model_inputs import ModelInputs
from worker.sampler import SamplingTensors


@dataclass
class StepInputs:
    """Everything a step needs on the device, prepared on the host."""

    step_id: int
    # None until every token is known (a step planned while its predecessor ran).
    input_ids: torch.Tensor | None
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]
    sampling_rows: np.ndarray
    sampling: SamplingTensors
    generators: list[torch.Generator | None]
    # The host inputs, kept until the token ids are gathered and uploaded.
    inputs: ModelInputs | None = None
    # Sampler positions of the requests that asked for logprobs (rank 0 only; None when
    # none did) and how many top alternatives each wants.
    logprob_rows: torch.Tensor | None = None
    logprob_counts: list[int] = field(default_factory=list)
    # Filled by collect: parallel to sampling_req_ids, or empty when nobody asked.
    logprobs: list[Logprobs | None] = field(default_factory=list)
    # Requests that asked for prompt_logprobs and prefill prompt tokens in this step;
    # their logprobs are computed at launch (rank 0 keeps them).
    prompt_plan: list[PromptPlan] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Sampler positions of the requests whose embedding this step yields (their prompt
    # ends here; rank 0 only), else None.
    embed_rows: np.ndarray | None = None
    drafts: DraftPlan | None = None  # speculative decoding: the drafts to verify


@dataclass
class DraftPlan:
    """One step's drafts, by sampling request (scheduled order): worker/spec_verify.py."""

    drafts: list[list[int] | None]  # [K] None: the request drafted nothing
    logits_indices: np.ndarray  # [P] int64 every position whose logits are needed
    first_rows: np.ndarray  # [K] int64 row in those logits of each request's first
    rows: np.ndarray  # [D] int64 batch rows of the drafted requests
    temperature: np.ndarray  # [K] float32 each sampling request's temperature
    # Per verified position (P rows): the sampling settings with their extras (penalties,
    # biases, masks, bans), when some request of the step has extras; else None.
    sampling: SamplingTensors | None = None
    # Rank 0, when some drafted request asked for logprobs: per sampling request, the
    # logprobs of the tokens it emits after its first (empty when it drafted nothing).
    extra_logprobs: list[list[Logprobs]] = field(default_factory=list)

    def sizes(self) -> np.ndarray:
        """[K] int64 positions verified per sampling request (its drafts + 1)."""
        return np.diff(np.append(self.first_rows, len(self.logits_indices)))


@dataclass
class PromptPlan:
    """One request's prompt tokens whose logprobs this step's chunk yields: tokens
    start .. start + count - 1, each predicted by the hidden state before it, which sits
    at flat_start + j in the step's tokens."""

    req_id: str
    start: int
    flat_start: int
    targets: np.ndarray  # [count] the prompt tokens themselves
    num_top: int


@dataclass
class InFlight:
    """A launched step whose tokens the device is still producing."""

    step: StepInputs
    tokens: torch.Tensor | None  # [K] on the device; None when no request samples
    logits: torch.Tensor | None  # kept for the logprobs, when some request asked
    done: torch.cuda.Event | None  # recorded after the step's work on a GPU
    # The batch's row_changes at launch: while equal, the sampling rows are where they were.
    rows_at_launch: int = 0
    # The final hidden states of step.embed_rows, when some request asked.
    embed_hidden: torch.Tensor | None = None
    # Speculative decoding: per sampling request, the tokens after its first.
    spec_tokens: list[list[int]] | None = None
