"""Reading a worker's ModelRunnerOutput in the core: the whole-output checks, prompt
logprobs gathered across chunks, and the fields attached to a step's RequestOutputs
after its tokens are applied. The wire is not trusted: a wrong answer stops the engine
with a reason instead of leaving a request waiting forever."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from msgspec.structs import replace

from enginecore.request import Request
from protocol.engine import Logprobs, RequestOutput
from protocol.worker import ModelRunnerOutput, PromptLogprobs, SchedulerOutput


def check_runner_output(
    so: SchedulerOutput, output: ModelRunnerOutput, due: deque[tuple[int, int]], vocab_size: int
) -> None:
    """The cheap whole-output checks (C loops): the output answers the oldest step in
    flight (due's head, popped), with one token in the vocabulary per request due."""
    if output.step_id != so.step_id or not due or due[0][0] != so.step_id:
        raise ValueError(f"model output of step {output.step_id} does not answer step {so.step_id}")
    num_due = due.popleft()[1]
    tokens = output.sampled_token_ids
    if len(output.req_ids) != num_due or len(tokens) != num_due:
        raise ValueError(
            f"{len(output.req_ids)} requests and {len(tokens)} tokens in the output of "
            f"step {so.step_id}, but {num_due} requests were due to sample"
        )
    if output.logprobs and len(output.logprobs) != num_due:
        raise ValueError(f"logprobs for {len(output.logprobs)} of {num_due} requests")
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise ValueError(f"sampled token id {bad} is outside the vocabulary")


def take_prompt_logprobs(
    requests: Mapping[str, Request], chunks: list[PromptLogprobs]
) -> dict[str, list[Logprobs]]:
    """Add each chunk to its request's prompt logprobs; those now complete, by request
    (sent with its first token, which this step samples). A chunk that repeats what
    arrived (the prompt recomputed after a preemption) adds nothing; one that skips
    tokens stops the engine."""
    complete: dict[str, list[Logprobs]] = {}
    for chunk in chunks:
        request = requests.get(chunk.req_id)
        if request is None or request.prompt_logprobs is None:
            continue  # finished, aborted, or answered already
        have = request.prompt_logprobs
        due = len(have) + 1  # the next prompt token without a logprob
        end = chunk.start + len(chunk.logprobs)
        if chunk.start > due or end > request.num_prompt_tokens:
            raise ValueError(
                f"prompt logprobs of request {chunk.req_id} for tokens {chunk.start} to "
                f"{end - 1}, but token {due} is due and the prompt has "
                f"{request.num_prompt_tokens}"
            )
        have += chunk.logprobs[due - chunk.start :]
        if len(have) == request.num_prompt_tokens - 1:
            complete[chunk.req_id] = have
            request.prompt_logprobs = None
    return complete


def attach_first_token_extras(
    outputs: list[RequestOutput],
    queue_times: dict[str, float],
    prompt_logprobs: dict[str, list[Logprobs]] | None,
    output: ModelRunnerOutput,
) -> list[RequestOutput]:
    """What goes with a request's first token: its queue time (popped from queue_times),
    its prompt logprobs, its prompt embedding. Most steps carry none and copy nothing."""
    if queue_times:  # some request scheduled for the first time waits for its token
        for k, o in enumerate(outputs):
            queued = queue_times.pop(o.request_id, None)
            if queued is not None:
                outputs[k] = replace(o, queued_s=queued)
    if prompt_logprobs:
        outputs = [
            replace(o, prompt_logprobs=prompt_logprobs[o.request_id])
            if o.request_id in prompt_logprobs
            else o
            for o in outputs
        ]
    if output.embeddings:
        # With the request's first token (the step that finished its prompt).
        vectors = {e.req_id: e.vector for e in output.embeddings}
        outputs = [
            replace(o, embedding=vectors[o.request_id]) if o.request_id in vectors else o
            for o in outputs
        ]
    return outputs
