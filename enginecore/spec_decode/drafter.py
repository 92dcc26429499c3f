"""The Drafter: which requests draft, how many tokens each step, and what acceptance
they had (vLLM's spec-decode counters).

Every request drafts except one with structured outputs: its grammar would have to
advance through each draft before the draft is verified; such a request decodes one
token a step as without speculation. Penalties, min_tokens, logit biases, allowed and
banned tokens and logprobs are applied at each verified position by the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enginecore.request import Request
from enginecore.spec_decode.ngram import NgramIndex
from enginecore.spec_decode.suffix import SuffixCache
from protocol.engine import SamplingParams
from protocol.speculative import SpecDecodeStats, SpeculativeConfig

# After this many verifications in a row accepted nothing, a request stops drafting for
# a while (doubling each time, up to MAX_PAUSE steps): on free text drafts are rare and
# almost always wrong; each costs a step the tokens it verifies, and a step that drafts
# cannot overlap the next (enginecore/core.py).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 32
# A lookup that found nothing pauses the next ones for a step per dry lookup in a row,
# up to MAX_DRY_PAUSE: a copying request must not wait long once its answer starts
# repeating, while free text is not looked up every step.
MAX_DRY_PAUSE = 4


def can_draft(params: SamplingParams) -> bool:
    """Whether the verifier reproduces this request's sampling exactly."""
    return params.structured_outputs is None


@dataclass
class SpecDecodeCounters:
    """Cumulative since start, vLLM's names: verifications that had drafts, drafted
    tokens, accepted drafts, and accepted drafts by position (0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class _DraftState:
    __slots__ = ("dry", "index", "last_step", "misses", "resume_at")

    def __init__(self, index: NgramIndex | None) -> None:
        self.index = index
        self.misses = 0  # verifications in a row that accepted nothing
        self.dry = 0  # lookups in a row that found no draft
        self.resume_at = 0  # the first step it drafts again
        self.last_step = 0  # the step it last drafted in


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self._states: dict[str, _DraftState] = {}
        self._suffix = SuffixCache(config) if config.method == "suffix" else None
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * self.k)

    def add(self, request: Request) -> None:
        """Track a request just added, if it may draft."""
        if not can_draft(request.sampling_params):
            return
        cfg = self.config
        index = NgramIndex(cfg.lookup_min, cfg.lookup_max) if self._suffix is None else None
        self._states[request.request_id] = _DraftState(index)

    def finish(self, request: Request) -> None:
        """A request ended: forget it (suffix decoding keeps its output for others)."""
        state = self._states.pop(request.request_id, None)
        if state is not None and self._suffix is not None:
            self._suffix.finish(
                request.request_id, request.all_token_ids, request.num_prompt_tokens
            )

    def wants(self, request_id: str, step: int) -> bool:
        """Whether the request would try to draft in step `step`."""
        state = self._states.get(request_id)
        return state is not None and state.resume_at <= step

    def propose(self, request: Request, limit: int, step: int) -> list[int] | None:
        """At most min(K, limit) drafts to follow the request's tokens in step `step`,
        or None."""
        state = self._states.get(request.request_id)
        if state is None or limit < 1 or state.resume_at > step:
            return None
        k = self.k if self.k < limit else limit
        tokens = request.all_token_ids
        if state.index is not None:
            drafts = state.index.propose(tokens, k)
        else:
            assert self._suffix is not None
            drafts = self._suffix.propose(request.request_id, tokens, request.num_prompt_tokens, k)
        if not drafts:
            state.dry += 1
            state.resume_at = step + 1 + min(state.dry, MAX_DRY_PAUSE)
            return None
        state.dry = 0
        state.last_step = step
        return drafts

    def stats(self) -> SpecDecodeStats:
        c = self.counters
        return SpecDecodeStats(
            c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos)
        )

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification's result: counters, and the request's back-off."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        per_pos = c.accepted_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        state = self._states.get(request_id)
        if state is None:
            return
        if num_accepted:
            state.misses = 0
        else:
            self._missed(state, state.last_step)

    @staticmethod
    def _missed(state: _DraftState, step: int) -> None:
        state.misses += 1
        if state.misses >= MISSES_BEFORE_PAUSE:
            pause = min(1 << (state.misses - MISSES_BEFORE_PAUSE + 1), MAX_PAUSE)
            state.resume_at = step + 1 + pause
