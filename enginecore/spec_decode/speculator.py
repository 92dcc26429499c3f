"""The scheduler's side of speculative decoding: drafts for a running request's next
step, and the tokens a verification accepted applied in order.

A request with K drafts runs K + 1 tokens: its last token plus the drafts. Only the
last token counts as computed when scheduled; the drafts take lookahead slots, which
allocate_slots never hashes. The answer brings 1 + a tokens (a accepted drafts, then the
bonus or correcting token): each is appended and checked for a stop in order (tokens
after a stop are dropped), num_computed_tokens grows by a, the blocks full of verified
tokens are published, and the blocks past the request's tokens are freed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from msgspec.structs import replace

from enginecore.kv_cache_manager import KVCacheManager
from enginecore.request import Request, RequestStatus
from enginecore.spec_decode.drafter import Drafter
from enginecore.stop_conditions import stop_reason
from protocol.engine import RequestOutput
from protocol.speculative import SpeculativeConfig, speculative_config_error
from protocol.worker import ModelRunnerOutput, SchedulerOutput


class Speculator:
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, vocab_size: int) -> None:
        error = speculative_config_error(config)
        if error is not None:
            raise ValueError(f"speculative_config: {error}")
        self.drafter = Drafter(config)
        self.kv = kv
        self.vocab_size = vocab_size

    def serial(self, last_sent: SchedulerOutput, running: list[Request], step: int) -> bool:
        """Whether the next step must wait for the answer to `last_sent`: it has drafts
        (their accepted count decides the next positions), or some running request would
        draft next (drafts follow a request's last token, which that answer brings).
        Otherwise steps overlap as with async scheduling."""
        if last_sent.spec_token_ids:
            return True
        wants = self.drafter.wants
        return any(wants(r.request_id, step) for r in running)

    def drafts(self, request: Request, budget_left: int, step: int) -> list[int] | None:
        """Drafts for a decoding request, within the step's budget left after its own
        token and the ones later requests need, and the request's remaining length (so
        that every accepted token is one it may still produce)."""
        limit = request.max_num_tokens - len(request.all_token_ids) - 1
        if budget_left < limit:
            limit = budget_left
        return self.drafter.propose(request, limit, step)

    def apply(
        self,
        so: SchedulerOutput,
        output: ModelRunnerOutput,
        outputs: list[RequestOutput],
        requests: Mapping[str, Request],
        eos: frozenset[int],
        end: Callable[[Request, str], None],
    ) -> int:
        """Apply the accepted tokens of the requests that verified drafts (how many were
        appended after the first tokens); `end` finishes a request one of them stopped.
        ValueError for an answer that does not match the
        drafts sent (the wire is not trusted)."""
        extras = output.spec_token_ids
        if extras and len(extras) != len(output.req_ids):
            raise ValueError(f"accepted tokens for {len(extras)} of {len(output.req_ids)} requests")
        extra_logprobs = output.spec_logprobs
        if extra_logprobs and (
            len(extra_logprobs) != len(extras)
            or any(lp and len(lp) != len(t) for lp, t in zip(extra_logprobs, extras))
        ):
            raise ValueError("logprobs of accepted tokens that do not match the tokens")
        where = {o.request_id: k for k, o in enumerate(outputs)}
        drafted = so.spec_token_ids
        appended_total = 0
        for k, rid in enumerate(output.req_ids):
            drafts = drafted.get(rid)
            extra = extras[k] if extras else []
            if drafts is None:
                if extra:
                    raise ValueError(f"accepted tokens for request {rid}, which drafted none")
                continue
            self._check(rid, drafts, output.sampled_token_ids[k], extra)
            self.drafter.record(rid, len(drafts), len(extra))
            request = requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING or not extra:
                if request is not None and request.status == RequestStatus.RUNNING:
                    self.kv.free_lookahead(request)
                continue  # finished by its first token (or before): the rest is dropped
            appended, reason = _append(request, extra, eos)
            appended_total += len(appended)
            at = where[rid]
            o = outputs[at]
            logprobs = o.logprobs
            if logprobs is not None:  # it asked: the worker sent one per accepted token
                if not extra_logprobs or not extra_logprobs[k]:
                    raise ValueError(f"request {rid}: no logprobs for its accepted tokens")
                logprobs = logprobs + extra_logprobs[k][: len(appended)]
            outputs[at] = replace(
                o,
                new_token_ids=o.new_token_ids + appended,
                finish_reason=reason,
                num_preemptions=request.num_preemptions if reason else 0,
                logprobs=logprobs,
            )
            if reason is not None:
                end(request, reason)
                continue
            self.kv.free_lookahead(request)
            self.kv.cache_blocks(request, request.num_computed_tokens)
        return appended_total

    def _check(self, rid: str, drafts: list[int], first: int, extra: list[int]) -> None:
        accepted = len(extra)
        if accepted > len(drafts):
            raise ValueError(f"request {rid}: {accepted} drafts accepted of {len(drafts)}")
        if accepted and ([first, *extra[:-1]] != drafts[:accepted]):
            raise ValueError(f"request {rid}: accepted tokens differ from its drafts")
        if accepted and not 0 <= extra[-1] < self.vocab_size:
            raise ValueError(f"request {rid}: token id {extra[-1]} is outside the vocabulary")


def _append(
    request: Request, tokens: list[int], eos: frozenset[int]
) -> tuple[list[int], str | None]:
    """Append tokens after the request's first new one, each now verified; stop at the
    first that ends it."""
    ids = request.all_token_ids
    for n, token in enumerate(tokens, 1):
        ids.append(token)
        # The token before it was verified: its KV is in the cache now.
        request.num_computed_tokens += 1
        num_tokens = len(ids)
        if num_tokens >= request.hash_at:
            request.extend_hashes()
        if token in request.stop_token_set or num_tokens >= request.max_num_tokens:
            reason = stop_reason(request, token, num_tokens, eos)
            if reason is not None:
                return tokens[:n], reason
    return tokens, None
