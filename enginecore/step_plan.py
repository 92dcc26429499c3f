"""One schedule() call's plan, and the small helpers the scheduler's loops share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enginecore.request import Request
from protocol.worker import NewRequestData

if TYPE_CHECKING:
    from enginecore.kv_cache_manager import KVCacheManager
    from enginecore.scheduler import Scheduler, SchedulerConfig

# Never mutated: StepPlan replaces it with a dict of its own before adding drafts.
NO_DRAFTS: dict[str, list[int]] = {}
# The prefill tokens a step with decodes may always carry, however few decodes it has:
# a prompt arriving beside one running request still moves at a useful pace.
MIN_PREFILL_CHUNK = 32
# Requests that arrive together form a wave: the first to get its first token waits up to
# this many steps (once) while the rest of the wave prefills in full steps, so the wave
# decodes together and no later decode shares a step with a mate's prefill (hold_for_wave).
# Enough for a few long uncached prompts (chat system prompts); bounded, so a fresh stream
# never waits on an endless queue.
WAVE_HOLD_STEPS = 16
# A wave of at most WAVE_DEFER_STREAMS streams whose prompts take at most WAVE_DEFER_STEPS
# full steps gets its first tokens together in its last step (StepPlan.defer): a stream's
# wait is then in its time to first token, not between its first two tokens. A wider
# wave hands out first tokens as its prompts end: there the wait would add to the time to
# first token of most of a busy server's requests, and decode steps are slower anyway.
WAVE_DEFER_STREAMS = 4
WAVE_DEFER_STEPS = 4
# StepPlan.hold: which requests with one token to go wait this step. A wave's last step
# runs the prompts' last tokens (HOLD_STREAMS: only fresh streams wait, so every stream's
# next token comes in one step); its steps before run no such token (HOLD_ALL).
HOLD_STREAMS = 1
HOLD_ALL = 2
# A fresh stream: its first token and at most one more (async scheduling schedules a
# first decode before the rest of its wave has reached the core).
FRESH_TOKENS = 2
_UNKNOWN = -1


class StepPlan:
    """What one schedule() call decided, in wire order, built up while deciding (running
    requests, then admissions) and encoded once by _build_output."""

    __slots__ = (
        "budget",
        "cached_blocks",
        "cached_computed",
        "cached_counts",
        "cached_ids",
        "cached_resumed",
        "defer",
        "hold",
        "new_counts",
        "new_reqs",
        "num_due",
        "num_running",
        "preempted",
        "prefill_left",
        "spec_token_ids",
        "total",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left this step
        self.total = 0  # tokens scheduled
        self.num_running = 0  # leading cached_* entries that are running requests
        self.num_due = 0  # requests whose tokens this step completes: each samples one
        self.preempted: list[str] = []
        # Prefill tokens the step's decodes still allow (prefill_room); counted when the
        # first prefill needs it, so decode-only steps never walk the running requests.
        self.prefill_left = _UNKNOWN
        self.hold = 0  # who waits for the prompts beside them (HOLD_*, hold_for_wave)
        self.defer = False  # a prompt finished this step keeps its last token (hold_for_wave)
        self.cached_ids: list[str] = []
        self.cached_blocks: list[list[list[int]] | None] = []
        self.cached_computed: list[int] = []
        # After the running ones: True per resumed admission (the rest are all False).
        self.cached_resumed: list[bool] = []
        self.cached_counts: list[int] = []
        self.new_reqs: list[NewRequestData] = []
        self.new_counts: list[int] = []
        # Drafts per request id (speculative decoding); the shared empty dict when none,
        # so a step without drafts builds nothing.
        self.spec_token_ids: dict[str, list[int]] = NO_DRAFTS

    def prefill_room(self, running: list[Request], num_waiting: int, per_request: int) -> int:
        """Prefill tokens this step may still take: the whole budget when no running
        request decodes (nobody waits for a token, or the decodes hold), else per_request
        for each open request, running or waiting (at least MIN_PREFILL_CHUNK): a few
        decodes keep their pace beside a new prompt, and a long queue still fills the
        step."""
        if self.prefill_left == _UNKNOWN:
            self.prefill_left = self.budget
            for request in () if self.hold else running:
                # One token to go (its own, or the one in flight): it decodes. A prompt
                # finished earlier in this loop counts too: it decodes from the next step.
                left = len(request.all_token_ids) + request.num_pending_tokens
                if left - request.num_computed_tokens <= 1:
                    room = per_request * (len(running) + num_waiting)
                    self.prefill_left = room if room > MIN_PREFILL_CHUNK else MIN_PREFILL_CHUNK
                    break
        return self.prefill_left

    def hold_for_wave(self, sched: Scheduler, held: int) -> int:
        """Decide how this step treats a wave (self.hold, self.defer, the prefill cap), for
        WAVE_HOLD_STEPS steps in a row at most; the new count of such steps.

        Requests that arrive together form a wave; a budget smaller than the wave's prompts
        splits them over steps, and its first requests would start decoding under the
        prefill cap beside the rest, so the wave drifts apart for good (a decode then
        shares most steps with a prompt's chunk). While no established stream runs (a
        fresh one has FRESH_TOKENS at most: a stream waits once) and the prompts still to
        compute (running chunks, waiting requests that fit, by what they compute beyond
        cached and shared blocks) fill the steps left:
        - a fresh stream ready to decode waits (hold), and so does a prompt's last token,
          until the wave's last step (its prompts fit): there the prompts' last tokens
          run beside the last chunks, uncapped, and fresh streams wait once more, so the
          whole wave decodes its next token in one step;
        - a small wave (WAVE_DEFER_STREAMS, WAVE_DEFER_STEPS) that does not end this step
          defers its first tokens: a prompt that would end keeps its last token for the
          wave's last step."""
        running = sched.running
        fresh = 0
        left = 0
        prefilling: list[Request] = []
        for request in running:
            known = len(request.all_token_ids) + request.num_pending_tokens
            if known - request.num_computed_tokens > 1:
                left += known - request.num_computed_tokens
                prefilling.append(request)
            elif known - request.num_prompt_tokens > FRESH_TOKENS:
                return 0
            else:
                fresh += 1
        if held >= WAVE_HOLD_STEPS:
            return held  # spent: no second wait until these streams are established
        budget = self.budget
        limit = (WAVE_HOLD_STEPS - held) * budget
        # Waiting prompts count what they will compute: a wave of chat requests shares
        # its system prompts, each computed once (by the first) or already cached.
        shared: set[bytes] = set()
        if sched.waiting:  # only they read it: a lone long prompt's chunks skip it
            for request in prefilling:
                shared.update(request.block_hashes)
        kv = sched.kv_cache_manager
        room = sched.config.max_num_seqs - len(running)
        for request in sched.waiting:
            if room <= 0 or left > limit:
                break
            left += kv.uncached_prompt_tokens(request, shared)
            room -= 1
        if not 0 < left <= limit:
            return 0
        if left + fresh <= budget:
            if not fresh:
                return 0
            self.hold = HOLD_STREAMS
        else:
            self.hold = HOLD_ALL if fresh else 0
            streams = sched.config.max_num_seqs - room  # running, and the waiting counted
            small = streams <= WAVE_DEFER_STREAMS
            self.defer = small and left + fresh <= WAVE_DEFER_STEPS * budget
        return held + 1

    def chunk(self, request: Request, num_left: int, cap: int) -> int:
        """The tokens of a prompt's next chunk, num_left to go: at most cap, and not its
        last token while a small wave defers its first tokens (hold_for_wave)."""
        if num_left > cap:
            return cap
        if self.defer and num_left > 1 and request.num_output_tokens == 0:
            return num_left - 1
        return num_left

    def add_admitted(
        self, request: Request, table: list[list[int]], num_hit: int, num_new: int
    ) -> None:
        """An admitted request, from token num_hit: resumed after preemption (the worker
        kept its tokens; the table is new), or new (its prompt and whole table)."""
        if request.known_to_worker:
            self.cached_ids.append(request.request_id)
            self.cached_blocks.append(table)
            self.cached_computed.append(num_hit)
            self.cached_resumed.append(True)
            self.cached_counts.append(num_new)
            return
        self.new_reqs.append(
            NewRequestData(
                request.request_id,
                request.all_token_ids[: request.num_tokens],
                request.sampling_params,
                table,
                num_hit,
            )
        )
        self.new_counts.append(num_new)
        request.known_to_worker = True

    def add_drafts(self, request_id: str, drafts: list[int]) -> int:
        """Send drafts for a request; how many."""
        if self.spec_token_ids is NO_DRAFTS:
            self.spec_token_ids = {}
        self.spec_token_ids[request_id] = drafts
        return len(drafts)


def rank(request: Request) -> tuple[int, int]:
    """Its place under the priority policy: lower priority values first, then arrival."""
    return request.priority, request.arrival


def block_ids(blocks: tuple) -> list[list[int]] | None:
    """Block ids per group, or None when no group got a block (the common decode step)."""
    if not any(blocks):
        return None
    return [[b.block_id for b in group] for group in blocks]


def resume_fits(
    kv: KVCacheManager, running: list[Request], num_tokens: int, config: SchedulerConfig
) -> bool:
    """Whether a preempted request's num_tokens fit beside what the running requests
    will take while it recomputes them: the rest of their prompts and the tokens they
    decode meanwhile. Resumed with less, the next block any of them needs preempts it
    again (it is the latest admitted) before it made progress. Runs only while a
    preempted request heads the queue."""
    chunk = config.max_num_batched_tokens
    held = kv.max_blocks_held
    # Its recompute gets what the running requests leave of each step's budget.
    steps = -(-num_tokens // max(chunk - len(running), 1))
    need = held(num_tokens, chunk)
    for request in running:
        computed = request.num_computed_tokens
        need += held(request.num_tokens + steps, chunk) - held(computed, chunk)
    return kv.num_free_blocks >= need
