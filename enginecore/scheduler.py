"""The Scheduler: one rule for prefill and decode, under a token budget.

Each step moves every request's num_computed_tokens toward its num_tokens. Running
requests go first (decodes and unfinished prefill chunks), then waiting requests in the
policy's order (enginecore/request_queue.py: arrival, or priority then arrival), each
admitted only after a prefix-cache lookup and a successful allocate_slots. When a running
request cannot get a block, the last running request in that order (the latest arrived;
under the priority policy the lowest priority) is preempted (blocks freed, recomputed
later) and the allocation retried. The running list is kept in that order.

schedule() may run again before the last step's answer is applied (async scheduling):
a request's length then counts the tokens steps in flight will sample
(Request.num_pending_tokens), and update_from_output applies answers oldest first.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat

from msgspec.structs import replace

from enginecore.errors import ConfigError
from enginecore.kv_cache_manager import KVCacheManager
from enginecore.kv_tier_loads import TierLoads
from enginecore.request import Request, RequestStatus
from enginecore.request_checks import request_error
from enginecore.request_queue import make_request_queue
from enginecore.runner_output import (
    attach_first_token_extras,
    check_runner_output,
    take_prompt_logprobs,
)
from enginecore.spec_decode.speculator import Speculator
from enginecore.step_plan import (
    HOLD_ALL,
    WAVE_HOLD_STEPS,
    StepPlan,
    block_ids,
    rank,
    resume_fits,
)
from enginecore.stop_conditions import stop_reason, stop_token_set
from protocol.block_hash import HashAlgo
from protocol.config import SchedulingPolicy
from protocol.engine import (
    BUILTIN_SAMPLING_DEFAULTS,
    RequestOutput,
    SamplingDefaults,
    SamplingParams,
    SchedulerStats,
)
from protocol.kv_cache import KVCacheConfig
from protocol.kv_events import MEDIUM_GPU, KVCacheEvent
from protocol.speculative import SpeculativeConfig
from protocol.worker import (
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
    TierOutput,
    is_answered,
    with_kv_tier,
)


class DuplicateRequestId(ValueError):
    """A new request named an open request's id."""


@dataclass(frozen=True)
class SchedulerConfig:
    # Required: the settings take EngineArgs' values (through enginecore.core's
    # scheduler_config), max_model_len the core's resolved limit; no second copy here.
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool
    hash_algo: HashAlgo
    scheduling_policy: SchedulingPolicy
    # A decoding step's prefill tokens per open request (step_plan.prefill_room); 0: no cap.
    prefill_tokens_per_request: int = 0
    enable_kv_events: bool = False
    kv_events_medium: str = MEDIUM_GPU  # where the workers keep KV ("GPU" or "CPU")
    hash_seed: bytes | None = None  # the block-hash root's secret (see block_hash.root_hash)
    speculative_config: SpeculativeConfig | None = None  # drafts (spec_decode/); None: off
    kv_tier_slots: int = 0  # blocks of the second KV tier (enginecore/kv_tier.py); 0: none
    kv_tier_disk_slots: int = 0  # blocks of its disk level; 0: none
    kv_tier_load_bytes: int = 0  # per worker a step loads ahead (kv_tier_loads.py); 0: 64 MiB

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        sampling_defaults: SamplingDefaults = BUILTIN_SAMPLING_DEFAULTS,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        # Any of them ends a request (config.json's and generation_config.json's ids).
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampling_defaults = sampling_defaults
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,
            enable_kv_events=config.enable_kv_events,
            kv_events_medium=config.kv_events_medium,
            hash_seed=config.hash_seed,
            kv_tier_slots=config.kv_tier_slots,
            kv_tier_disk_slots=config.kv_tier_disk_slots,
        )
        if (tier := self.kv_cache_manager.tier) is not None and tier.disk is not None:
            tier.cap_blocks = (config.max_num_batched_tokens - 1) // tier.block_size
        self.requests: dict[str, Request] = {}
        # Disk hits load before they compute (kv_tier_loads.py); None: no such loads.
        self.loads = TierLoads.make(self.kv_cache_manager, config.kv_tier_load_bytes)
        spec = config.speculative_config
        self.spec = None if spec is None else Speculator(spec, self.kv_cache_manager, vocab_size)
        self.waiting = make_request_queue(config.scheduling_policy)
        self._by_priority = config.scheduling_policy == "priority"
        self._arrivals = 0  # requests added: the next one's arrival number
        self.running: list[Request] = []
        # Announced to the workers with the next SchedulerOutput.
        self._finished_req_ids: list[str] = []
        self.step_id = 0
        self._held = 0  # steps in a row whose decodes waited for a wave (hold_for_wave)
        self.num_preemptions = 0
        self.num_prompt_computed_tokens = self.num_prompt_cached_tokens = self.num_sampled = 0
        # (step id, requests due to sample) of each step sent and not yet answered, oldest
        # first (two with async scheduling): each answer must name exactly those.
        self._due: deque[tuple[int, int]] = deque()
        # Seconds each request scheduled once waited first, until its first output.
        self._queue_times: dict[str, float] = {}

    # -- requests in and out ----------------------------------------------------------
    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; a bad one fails alone: the error output is returned.
        DuplicateRequestId (nothing changed) if its id is already open."""
        rid = request.request_id
        if rid in self.requests:
            raise DuplicateRequestId(f"request id {rid!r} is already open; request refused")
        error = request_error(request, self.config, self.vocab_size, self.kv_cache_manager)
        if error is not None:
            return RequestOutput(rid, [], "error", 0, f"request {rid}: {error}")
        # Unset sampling fields take the model's defaults here, once, so the workers
        # only ever see complete parameters whoever the client was.
        params = request.sampling_params = request.sampling_params.resolve(self.sampling_defaults)
        request.max_num_tokens = min(
            request.num_prompt_tokens + params.max_tokens, self.config.max_model_len
        )
        request.stop_token_set = stop_token_set(params, self.eos_token_ids)
        request.arrival = self._arrivals
        request.arrived_at = time.monotonic()
        self._arrivals += 1
        self.requests[rid] = request
        self.waiting.add(request)
        if self.spec is not None:
            self.spec.drafter.add(request)
        return None

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """A Request hashed the way this scheduler's cache keys blocks (ValueError for a
        malformed one); add it with add_request."""
        return Request(
            request_id,
            prompt_token_ids,
            self.kv_cache_manager.block_hasher,
            cache_salt=cache_salt,
            wants_prompt_logprobs=sampling_params.prompt_logprobs is not None,
            sampling_params=sampling_params,
            priority=priority,
        )

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, in order (empty when they are off)."""
        return self.kv_cache_manager.take_events()

    def check_capacity(self) -> None:
        """ConfigError unless one request of max_model_len tokens fits the pool: refusing
        to start beats failing every long request later."""
        config = self.config
        error = self.kv_cache_manager.capacity_error(
            config.max_model_len, config.max_num_batched_tokens
        )
        if error:
            raise ConfigError(error)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        aborted = set()
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status == RequestStatus.FINISHED:
                continue
            aborted.add(rid)
            self._close(request, "abort")
            outputs.append(RequestOutput(rid, [], "abort", max(request.num_cached_tokens, 0)))
        if aborted:
            self.running = [r for r in self.running if r.request_id not in aborted]
            self.waiting.remove_ids(aborted)
        return outputs

    def fail_all(self, reason: str) -> list[RequestOutput]:
        """Every open request fails with reason (a worker died); their blocks are freed."""
        outputs = []
        loading = self.loads.requests() if self.loads is not None else []
        for request in [*self.running, *self.waiting, *loading]:
            self._close(request, "error")
            cached = max(request.num_cached_tokens, 0)
            outputs.append(RequestOutput(request.request_id, [], "error", cached, reason))
        self.running = []
        self.waiting.clear()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.loads)

    def fail_unschedulable(self) -> list[RequestOutput]:
        """After a step that scheduled nothing: the head waiting request can never fit
        (nothing runs, yet it got no blocks); fail it alone."""
        if self.running or self.loads or not self.waiting:
            return []  # a loading request computes once its loads are known
        head = self.waiting.peek()
        usable = self.kv_cache_manager.num_usable_blocks
        reason = (
            f"request {head.request_id} needs more KV cache than exists: {head.num_tokens} "
            f"tokens do not fit in {usable} blocks"
        )
        out = self.abort_requests([head.request_id])
        return [RequestOutput(o.request_id, [], "error", 0, reason) for o in out]

    def reset_prefix_cache(self) -> bool:
        """False (nothing changed) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Debugging and tests: every KV invariant, and with no request open, every
        block back in the pool."""
        kv = self.kv_cache_manager
        kv.check_invariants(self.requests)
        if not self.has_unfinished_requests():
            free, usable = kv.num_free_blocks, kv.num_usable_blocks
            if free != usable:
                raise AssertionError(
                    f"no request is open but only {free} of {usable} blocks are free"
                )

    def _end(self, request: Request, reason: str, finished: set[str]) -> None:
        """A running request stopped by one of its accepted drafts."""
        self.kv_cache_manager.free(request)
        finished.add(request.request_id)
        self._finish(request, reason)

    def _close(self, request: Request, reason: str) -> None:
        """End an open request outside a step (abort, failure), freeing its blocks."""
        if request.holds_kv_blocks:  # running, loading, or loaded and waiting
            self.kv_cache_manager.free(request)
            if self.loads is not None:
                self.loads.drop(request.request_id)
        self._finish(request, reason)
        self._queue_times.pop(request.request_id, None)  # ended before its first token

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        if self.spec is not None:
            self.spec.drafter.finish(request)
        if request.known_to_worker:
            self._finished_req_ids.append(request.request_id)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (running requests first, then waiting ones in queue order,
        none if a running one had to be preempted) and encode it as a delta."""
        plan = StepPlan(self.config.max_num_batched_tokens)
        if self.config.prefill_tokens_per_request:  # a wave's decodes may wait (hold_for_wave)
            self._held = plan.hold_for_wave(self, self._held)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        if plan.hold and not plan.total and not plan.preempted:
            # The wave's prompts got no blocks: its decodes run after all, held no longer.
            self._held = WAVE_HOLD_STEPS
            return self.schedule()
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Decodes and unfinished prefill chunks; preempt the last running request (the
        latest arrived, or the lowest priority) while a block is short."""
        kv = self.kv_cache_manager
        max_len = self.config.max_model_len
        empty = kv.empty_blocks
        running = self.running
        # Local appends and allocate: this loop runs once per running request.
        allocate = kv.allocate_slots
        ids, blocks, computeds = plan.cached_ids, plan.cached_blocks, plan.cached_computed
        counts, preempted = plan.cached_counts, plan.preempted
        budget = plan.budget
        spec = self.spec
        per_request = self.config.prefill_tokens_per_request
        hold = plan.hold
        num_due = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            pending = request.num_pending_tokens
            remaining = num_new = len(request.all_token_ids) + pending - computed
            if pending and computed + remaining >= request.max_num_tokens:
                i += 1  # its token in flight ends it by length: running it on is waste
                continue
            if num_new > 1:  # a decode (one token) always fits: the loop needs budget > 0
                # A prefill chunk leaves a token for each running request after it, so
                # decodes never wait a step behind a prefill (one token when not even
                # that fits, so the chunk still moves). cap <= budget.
                cap = max(budget - (len(running) - i - 1), 1)
                if per_request:  # nor more than the decodes beside it allow (0: it waits)
                    cap = min(cap, plan.prefill_room(running, len(self.waiting), per_request))
                num_new = plan.chunk(request, num_new, cap)
            elif hold and (hold == HOLD_ALL or pending or request.num_output_tokens):
                i += 1  # its wave's prompts go first (StepPlan.hold_for_wave)
                continue
            if computed + num_new > max_len:
                num_new = max_len - computed
            if num_new <= 0:
                i += 1
                continue
            new_blocks = drafts = None
            if spec is not None and remaining == 1 and not pending:
                # Later requests keep a token each; no room for the drafts' slots: none.
                drafts = spec.drafts(request, budget - (len(running) - i), self.step_id + 1)
                if drafts:  # their lookahead slots, or none: no one is preempted for them
                    new_blocks = allocate(request, 1, 0, None, len(drafts))
                    drafts = drafts if new_blocks is not None else None
            while new_blocks is None:
                new_blocks = allocate(request, num_new)
                if new_blocks is not None:
                    break
                loading = self.loads.last() if self.loads else None  # first: least progress
                self._preempt(victim := loading or running.pop())
                if loading is None:
                    preempted.append(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            ids.append(request.request_id)
            # The common decode step got no block: skip building an empty id list.
            blocks.append(None if new_blocks is empty else block_ids(new_blocks))
            computeds.append(computed)
            k = plan.add_drafts(request.request_id, drafts) if drafts else 0
            counts.append(num_new + k)
            # Progress is counted at schedule time; the next step's allocation relies on it.
            request.num_computed_tokens = computed + num_new
            if num_new == remaining:
                num_due += 1
                request.num_pending_tokens = pending + 1
            budget -= num_new + k
            if remaining > 1 and per_request:
                plan.prefill_left -= num_new
            i += 1
        plan.total += plan.budget - budget
        plan.budget = budget
        plan.num_due += num_due
        plan.num_running = len(ids)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order after a prefix-cache lookup, while the
        budget, max_num_seqs and the pool allow."""
        kv = self.kv_cache_manager
        running, waiting = self.running, self.waiting
        per_request = self.config.prefill_tokens_per_request
        loads = self.loads  # two-phase disk loads (one full-attention group)
        ready = loads.ready if loads is not None else ()  # loaded from the tier: first
        while (ready or waiting) and plan.budget > 0:
            if len(running) + len(loads or ()) - bool(ready) >= self.config.max_num_seqs:
                break
            if per_request and plan.prefill_room(running, len(self.waiting), per_request) <= 0:
                break  # the running requests' decodes keep their pace
            request = ready[0] if ready else waiting.peek()
            if request.num_pending_tokens:
                break  # preempted with a step in flight: resume once its token is known
            held = request.holds_kv_blocks  # ready: tier loads verified to num_computed
            hits, num_hit = (None, 0) if held else kv.get_computed_blocks(request)
            # Blocks past the device hit that the KV tier holds load into new blocks.
            tier = None if request.skip_reading_prefix_cache or held else kv.tier
            limit = plan.budget if loads is None else 1 << 62  # loads first: no cap
            num_tier = kv.lookup_tier(request, num_hit, limit) if tier is not None else 0
            # Hybrid: a disk load may fail; the worker then recomputes it within the budget.
            reserve = tier.reserve if tier is not None and loads is None else 0
            base = request.num_computed_tokens if held else 0
            cap = plan.budget - reserve
            if per_request and cap > plan.prefill_left:
                cap = plan.prefill_left
            num_new = plan.chunk(request, request.num_tokens - base - num_hit - num_tier, cap)
            if (
                request.known_to_worker
                and running
                and not resume_fits(kv, running, request.num_tokens + 1, self.config)
            ):
                break  # resumed now, it would be the next victim: wait for room
            if loads is not None and tier is not None and tier.reserve:  # kv_tier_loads.py
                if not loads.admit(request, num_hit, hits, num_tier):  # type: ignore[union-attr]
                    break
                waiting.pop_head()
                continue
            new_blocks = kv.allocate_slots(
                request, num_new, num_hit, hits if num_hit else None, 0, num_tier
            )
            if new_blocks is None:
                break  # FCFS: nobody overtakes the head of the queue
            if tier is not None:  # admitted: its lookup counts once, its loads go out
                tier.load_found(kv.get_block_ids(request.request_id), num_hit)
                num_hit += num_tier  # loaded before the step's forward: computed
            num_hit += base
            ready.popleft() if held else waiting.pop_head()  # type: ignore[union-attr]
            if self._by_priority:
                # Ahead of every running request it outranks: scheduled before them, and
                # preempted after them.
                insort(running, request, key=rank)
            else:
                running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit + num_new
            if request.num_cached_tokens < 0:  # first scheduled: its prompt counts once
                request.num_cached_tokens = num_hit
                self.num_prompt_cached_tokens += num_hit
                self.num_prompt_computed_tokens += request.num_prompt_tokens - num_hit
            if not request.known_to_worker:  # its queue time goes with its first token
                self._queue_times[request.request_id] = time.monotonic() - request.arrived_at
            plan.add_admitted(request, kv.get_block_ids(request.request_id), num_hit, num_new)
            if num_hit + num_new == request.num_tokens:
                plan.num_due += 1
                request.num_pending_tokens = 1
            plan.budget -= num_new + reserve
            plan.total += num_new
            if per_request:
                plan.prefill_left -= num_new

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        """Encode the step: the delta the workers apply."""
        kv = self.kv_cache_manager
        cached_ids = plan.cached_ids
        cached_resumed = [False] * plan.num_running + plan.cached_resumed
        # Sliding windows freed leading blocks of some running requests: tell the worker.
        skipped = kv.take_skipped_blocks() if kv.has_sliding_window else None
        if skipped:
            cached_skipped = [skipped.get(rid) for rid in cached_ids[: plan.num_running]]
            cached_skipped += [None] * len(plan.cached_resumed)
        else:
            cached_skipped = [None] * len(cached_ids)
        total = plan.total
        finished, self._finished_req_ids = self._finished_req_ids, []
        self.step_id += 1
        so = SchedulerOutput(
            step_id=self.step_id,
            new_reqs=plan.new_reqs,
            cached_reqs=CachedRequestData(
                cached_ids, plan.cached_blocks, plan.cached_computed, cached_resumed, cached_skipped
            ),
            num_scheduled_tokens=plan.new_counts + plan.cached_counts,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids=plan.preempted,
            spec_token_ids=plan.spec_token_ids,
        )
        if kv.tier is not None:  # its transfers, with two-phase loads' share
            loads = self.loads
            so = with_kv_tier(
                so, kv.tier.take_ops() if loads is None else loads.take_ops(self.step_id)
            )
        if is_answered(so):  # it runs tokens, or loads to report on
            self._due.append((self.step_id, plan.num_due))
        return so

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.loads is not None:
            self.loads.drop(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        With async scheduling the next step may already be scheduled (and be running):
        a request it ran on that finishes here is finished all the same; the extra token
        that step samples for it is dropped when its answer comes.

        ValueError if the output does not answer the oldest step in flight exactly (the
        wire is not trusted: a wrong answer must stop the engine with a reason, not leave
        a request waiting forever)."""
        check_runner_output(scheduler_output, output, self._due, self.vocab_size)
        if isinstance(output, TierOutput) and (tier := self.kv_cache_manager.tier) is not None:
            tier.answered(output)  # load time; unreadable disk blocks
        if self.loads:  # loading requests whose loads are all known compute next
            self.loads.answered(scheduler_output.step_id, output)
        # Before the tokens: a request may finish at its first token, and still gets these.
        prompt_lps = output.prompt_logprobs
        answered = take_prompt_logprobs(self.requests, prompt_lps) if prompt_lps else None
        outputs: list[RequestOutput] = []
        finished: set[str] = set()
        eos = self.eos_token_ids
        # Parallel to req_ids when some request asked; else one shared None per token.
        logprobs = output.logprobs or repeat(None)
        get_request = self.requests.get
        running_status = RequestStatus.RUNNING  # an enum member lookup costs per token
        for rid, token, lp in zip(output.req_ids, output.sampled_token_ids, logprobs):
            request = get_request(rid)
            if request is None:
                continue  # finished or aborted while the step ran
            pending = request.num_pending_tokens - 1
            if pending < 0:  # the engine stops: no undo
                raise ValueError(f"a token for request {rid}, which was not due to sample")
            request.num_pending_tokens = pending
            # Request.append_output_token_ids, inlined: this loop runs once per token.
            ids = request.all_token_ids
            ids.append(token)
            num_tokens = len(ids)
            if num_tokens >= request.hash_at:
                request.extend_hashes()
            running = request.status == running_status
            if running and num_tokens + pending != request.num_computed_tokens + 1:
                raise ValueError(f"a token for request {rid}, which was not due to sample")
            # Most tokens end nothing: a set test, and the whole check only for a candidate.
            reason = (
                stop_reason(request, token, num_tokens, eos)
                if token in request.stop_token_set or num_tokens >= request.max_num_tokens
                else None
            )
            lps = None if lp is None else [lp]
            outputs.append(
                RequestOutput(rid, [token], reason, request.num_cached_tokens, None, lps)
            )
            if reason is not None:
                if running:
                    self.kv_cache_manager.free(request)
                    finished.add(rid)
                else:  # preempted by a step scheduled while this one ran: blocks are free
                    self.waiting.remove(request)
                self._finish(request, reason)
                if request.num_preemptions:  # rare: only the last output carries it
                    outputs[-1] = replace(outputs[-1], num_preemptions=request.num_preemptions)
        if scheduler_output.spec_token_ids:
            assert self.spec is not None
            end = lambda r, why: self._end(r, why, finished)  # noqa: E731
            self.num_sampled += self.spec.apply(
                scheduler_output, output, outputs, self.requests, eos, end
            )
        self.num_sampled += len(outputs)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return attach_first_token_extras(outputs, self._queue_times, answered, output)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.loads or ()),  # loading: not computing yet
            kv_cache_usage=kv.usage,
            prefix_cache_queries=pc.queries + pc.preempted_queries,
            prefix_cache_hits=pc.hits + pc.preempted_hits,
            num_preemptions=self.num_preemptions,
            step=self.step_id,
            num_prompt_computed_tokens=self.num_prompt_computed_tokens,
            num_prompt_cached_tokens=self.num_prompt_cached_tokens,
            num_sampled_tokens=self.num_sampled,
            spec_decode=None if self.spec is None else self.spec.drafter.stats(),
            kv_tier=kv.tier.wire_stats() if kv.tier is not None else None,
        )
