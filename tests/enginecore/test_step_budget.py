"""The step's token budget as a latency goal, on the real Scheduler stepped to the end
(every due request samples one token): a burst's prompts finish in arrival order, one
budget at a time; running decodes are scheduled in every step beside at most one budget
of prefill; a wave of requests split over steps decodes together and stays a wave; a
preempted request is not resumed only to be preempted again before it made progress."""

from __future__ import annotations

import itertools
import os

import pytest

from enginecore.kv_cache_config import with_num_blocks
from enginecore.scheduler import Scheduler
from enginecore.step_plan import FRESH_TOKENS, MIN_PREFILL_CHUNK, WAVE_HOLD_STEPS
from protocol.config import CPU_MAX_NUM_BATCHED_TOKENS
from protocol.engine import RequestOutput, SamplingParams
from protocol.kv_cache import KVCacheGroupSpec
from protocol.worker import ModelRunnerOutput, SchedulerOutput
from tests.helpers.kv_helpers import full, sched_config

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
VOCAB = 100
TOKEN = 7


def make(
    num_blocks: int,
    budget: int | None,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    per_request: int | None = None,
) -> Scheduler:
    config = sched_config(
        2048,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        prefill_tokens_per_request=per_request,
    )
    groups = [KVCacheGroupSpec(["l0"], full())]  # blocks of 4 tokens
    return Scheduler(config, with_num_blocks(groups, num_blocks), VOCAB)


def add(
    sched: Scheduler,
    rid: str,
    n: int,
    max_tokens: int,
    priority: int = 0,
    prefix: list[int] | None = None,
) -> None:
    # Distinct prompts (after `prefix`): no prefix hit shortens anyone's prefill.
    seed = sum(map(ord, rid))
    prompt = [3 + (seed * 13 + 7 * i) % (VOCAB - 3) for i in range(n)]
    if prefix is not None:
        prompt = prefix + prompt
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    assert sched.add_request(sched.new_request(rid, prompt, params, priority=priority)) is None


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[RequestOutput]]:
    so = sched.schedule()
    if not so.total_num_scheduled_tokens:
        return so, []
    rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
    due = [r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
    outs = sched.update_from_output(so, ModelRunnerOutput(so.step_id, due, [TOKEN] * len(due)))
    sched.check_invariants()
    return so, outs


def scheduled(so: SchedulerOutput) -> dict[str, int]:
    rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
    return dict(zip(rids, so.num_scheduled_tokens))


def test_a_burst_finishes_its_prompts_in_arrival_order_one_budget_at_a_time() -> None:
    # 16 prompts of 512 tokens under the CPU's default budget (512 tokens): the first
    # token of request i comes near step i, not all 16 after the whole burst's prefill.
    sched = make(num_blocks=16 * 160, budget=None)
    assert sched.config.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS == 512
    for i in range(16):
        add(sched, f"r{i}", 512, 8)
    first: dict[str, int] = {}
    n = 0
    while sched.has_unfinished_requests():
        so, outs = step(sched)
        n += 1
        assert so.total_num_scheduled_tokens <= CPU_MAX_NUM_BATCHED_TOKENS
        for out in outs:
            first.setdefault(out.request_id, n)
    steps = [first[f"r{i}"] for i in range(16)]
    assert steps == sorted(steps)  # arrival order
    assert steps[0] == 1 and steps[-1] >= 16  # spread over the burst
    assert len(set(steps)) == 16  # a wide wave's first tokens are not deferred


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_running_decodes_run_in_every_step_beside_at_most_one_budget_of_prefill(
    policy: str,
) -> None:
    """Four requests decode; then long prompts arrive, under priority ahead of them in the
    running order. Every step runs each decode that was running before it, and the step
    stays within the budget."""
    budget = 64
    sched = make(num_blocks=600, budget=budget, policy=policy)
    low, high = (1, 0) if policy == "priority" else (0, 0)
    for i in range(4):
        add(sched, f"d{i}", 8, 60, priority=low)
    for _ in range(3):
        step(sched)
    for i in range(3):
        add(sched, f"p{i}", 150, 4, priority=high)
    prefill_steps = 0
    while sched.has_unfinished_requests():
        decoding = [
            r.request_id for r in sched.running if r.num_computed_tokens == r.num_tokens - 1
        ]
        so, _ = step(sched)
        got = scheduled(so)
        assert all(got.get(rid) == 1 for rid in decoding), (decoding, got)
        assert so.total_num_scheduled_tokens <= budget
        prefill_steps += any(n > 1 for n in got.values())
    assert prefill_steps >= 3 * 150 // budget  # the prompts were chunked beside decodes


@pytest.mark.parametrize(("decoding", "per_request"), [(1, None), (3, None), (12, None), (12, 0)])
def test_a_prompt_beside_decodes_is_cut_to_what_they_allow(
    decoding: int, per_request: int | None
) -> None:
    """Requests decode when a 384-token prompt arrives under the CPU's defaults: each step
    carries at most 8 prefill tokens per open request (at least MIN_PREFILL_CHUNK), every
    decode runs in every step, and the prompt still moves each step until its first token.
    With the cap off (0) it takes the whole budget at once."""
    sched = make(num_blocks=2000, budget=None, per_request=per_request)
    room = sched.config.prefill_tokens_per_request * (decoding + 1)
    room = max(room, MIN_PREFILL_CHUNK) if room else CPU_MAX_NUM_BATCHED_TOKENS - decoding
    for i in range(decoding):
        add(sched, f"d{i}", 8, 200)
    step(sched)  # their prompts, in one step: nothing decoded yet, so no cap
    for _ in range(FRESH_TOKENS):
        step(sched)  # established streams: no prompt holds them (hold_for_wave)
    add(sched, "p", 384, 4)
    chunks = []
    while sched.requests["p"].num_computed_tokens < 384:
        so, _ = step(sched)
        got = scheduled(so)
        assert all(got[f"d{i}"] == 1 for i in range(decoding)), got
        chunks.append(got["p"])
    assert all(n == min(room, 384 - sum(chunks[:k])) for k, n in enumerate(chunks)), chunks


def test_a_burst_with_nothing_decoding_takes_the_whole_budget() -> None:
    # A small wave (2 steps): the first prompt keeps its last token for the wave's last
    # step, where every first token comes together.
    sched = make(num_blocks=2000, budget=None)
    for i in range(3):
        add(sched, f"r{i}", 300, 4)
    so, _ = step(sched)
    assert scheduled(so) == {"r0": 299, "r1": 213}
    so, outs = step(sched)
    assert scheduled(so) == {"r0": 1, "r1": 87, "r2": 300}
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]


def test_a_long_queue_beside_decodes_still_fills_the_step() -> None:
    """An offline batch: 64 prompts queued while the first ones decode. 8 tokens per open
    request is the whole budget, so every step is full and the queue is admitted at least
    as fast as without the cap (the first requests' decodes may wait for the rest of the
    batch, as a wave's do, which leaves the prompts more of each step)."""
    steps = {}
    for per_request in (None, 0):
        sched = make(num_blocks=8000, budget=None, max_num_seqs=64, per_request=per_request)
        for i in range(64):
            add(sched, f"r{i}", 128, 8)
        sizes = []
        while sched.waiting:
            so, _ = step(sched)
            sizes.append(so.total_num_scheduled_tokens)
        steps[per_request] = sizes
    assert all(n == CPU_MAX_NUM_BATCHED_TOKENS for n in steps[None][:-1]), steps[None]
    assert len(steps[None]) <= len(steps[0])


@pytest.mark.parametrize(
    ("num_blocks", "n", "prompt", "max_tokens", "budget"),
    [
        (49, 10, 21, 52, 64),
        (77, 9, 49, 59, 8),
        (47, 9, 51, 73, 32),
        (26, 11, 10, 66, 8),
        (66, 8, 59, 79, 8),
        (37, 6, 17, 60, 32),
    ],
)
def test_a_resumed_request_makes_progress_before_it_is_preempted_again(
    num_blocks: int, n: int, prompt: int, max_tokens: int, budget: int
) -> None:
    """Pools too small for the requests at once (preemption is certain): between two
    preemptions of one request it samples at least one token, and everything finishes."""
    sched = make(num_blocks, budget)
    for i in range(n):
        add(sched, f"r{i}", prompt, max_tokens)
    progressed: dict[str, bool] = {}
    finished = 0
    while sched.has_unfinished_requests():
        so, outs = step(sched)
        for rid in so.preempted_req_ids:
            assert progressed.get(rid, True), f"{rid} preempted twice without a new token"
            progressed[rid] = False
        for out in outs:
            progressed[out.request_id] = True
            finished += out.finish_reason == "length"
    assert finished == n and sched.num_preemptions > 0


def serve_streams(
    sched: Scheduler,
    streams: int,
    total: int,
    prompt: int,
    max_tokens: int,
    in_flight: int,
    systems: list[list[int]] | None = None,
) -> tuple[list[bool], list[list[str]], dict[str, list[int]]]:
    """A client holding `streams` requests open, as `bench serve` does: each request that
    ends is replaced by a new one. New requests arrive while the engine waits for an
    answer (steps take far longer than an arrival) and the core reads them after it, as
    its loop does; the first of a batch at an idle engine is scheduled alone (with async
    scheduling, its first decode too). `in_flight` 2: async scheduling. Returns per
    step whether it mixed a decode with a prompt's tokens, the requests that ended in
    each step, and the answers that brought each request's tokens. With `systems`,
    request i's prompt starts with systems[i % len(systems)] (a chat system prompt)."""
    waiting_to_arrive = list(range(total))

    def arrive(n: int) -> None:
        for _ in range(min(n, len(waiting_to_arrive))):
            i = waiting_to_arrive.pop(0)
            system = systems[i % len(systems)] if systems else None
            add(sched, f"w{i}", prompt, max_tokens, prefix=system)

    arrive(streams)
    flights: list[tuple[SchedulerOutput, list[str]]] = []
    mixed: list[bool] = []
    ended: list[list[str]] = []
    answers: dict[str, list[int]] = {}
    owed = 0  # requests the client will send: one per request ended
    while sched.has_unfinished_requests() or flights or (owed and waiting_to_arrive):
        if not sched.has_unfinished_requests() and not flights:
            arrive(1)  # the engine is idle: the first of the batch is scheduled alone
            owed -= 1
        sent = False
        if len(flights) < in_flight and sched.has_unfinished_requests():
            before = {r.request_id: r.num_computed_tokens for r in sched.running}
            pending = {rid: r.num_pending_tokens for rid, r in sched.requests.items()}
            so = sched.schedule()
            got = scheduled(so)
            if got:
                decode = any(before.get(r, 0) >= sched.requests[r].num_prompt_tokens for r in got)
                prefill = any(before.get(r, 0) < sched.requests[r].num_prompt_tokens for r in got)
                # A decode beside a prompt's chunk is a wait only if more prompt follows:
                # a wave's fresh streams go with its last chunk.
                more = any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.waiting)
                more = more or any(
                    r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
                )
                mixed.append(decode and prefill and more)
                due = [r for r in got if sched.requests[r].num_pending_tokens > pending.get(r, 0)]
                flights.append((so, due))
                sent = True
        if flights and (len(flights) >= in_flight or not sent):
            so, due = flights.pop(0)
            outs = sched.update_from_output(
                so, ModelRunnerOutput(so.step_id, due, [TOKEN] * len(due))
            )
            sched.check_invariants()
            arrive(owed)  # sent while the step ran, read after its answer
            owed = 0
            for out in outs:
                answers.setdefault(out.request_id, []).append(len(ended))
            done = [o.request_id for o in outs if o.finish_reason is not None]
            ended.append(done)
            owed += len(done)
    return mixed, ended, answers


@pytest.mark.parametrize("in_flight", [1, 2], ids=["serial", "async"])
@pytest.mark.parametrize("prompt", [384, 1088], ids=["3-steps", "9-steps"])
def test_a_wave_split_over_steps_decodes_together_and_stays_a_wave(
    in_flight: int, prompt: int
) -> None:
    """Four streams under the CPU's defaults (512-token budget, the prefill cap on): a
    wave's prompts take 3 steps (384 tokens each) or 9 (1088: a chat request's long
    system prompt, not yet cached), first tokens come in arrival order, the first
    requests wait for the rest instead of decoding beside their chunks, so no step mixes
    a decode with a prompt's tokens, and the wave ends together: its replacements (the
    first scheduled alone at an idle engine) form the next wave."""
    sched = make(num_blocks=4000, budget=None)
    mixed, ended, answers = serve_streams(sched, 4, 12, prompt, 24, in_flight)
    steps = [answers[f"w{i}"][0] for i in range(12)]
    assert steps == sorted(steps)  # arrival order
    assert not any(mixed), [i for i, m in enumerate(mixed) if m]
    end = {rid: k for k, done in enumerate(ended) for rid in done}
    # Async scheduling may decode a batch's first request once before the rest arrive
    # (when its prompt fits one step): it ends an answer ahead of its wave.
    spread = [max(end[f"w{i}"] for i in range(k, k + 4)) - end[f"w{k}"] for k in (0, 4, 8)]
    assert spread[0] == 0 and all(0 <= s <= in_flight - 1 for s in spread), ended
    if prompt <= CPU_MAX_NUM_BATCHED_TOKENS:
        assert spread == [0, in_flight - 1, in_flight - 1], ended


@pytest.mark.parametrize("in_flight", [1, 2], ids=["serial", "async"])
def test_a_chat_wave_counts_its_shared_system_prompts_once(in_flight: int) -> None:
    """16 chat streams: 4 system prompts of 1,024 tokens, each shared by a quarter of the
    requests, and 64 tokens of their own. Counted whole, the first wave's prompts would be
    34 full steps, past what a fresh stream waits for; computed, each system prompt once,
    they are 10, so the first streams wait for the wave and no step mixes a decode with a
    prompt's tokens."""
    systems = [[3 + (s * 31 + 11 * i) % (VOCAB - 3) for i in range(1024)] for s in range(4)]
    sched = make(num_blocks=8000, budget=None)
    mixed, _, answers = serve_streams(sched, 16, 32, 64, 24, in_flight, systems)
    assert len(answers) == 32
    assert not any(mixed), [i for i, m in enumerate(mixed) if m]


@pytest.mark.parametrize("in_flight", [1, 2], ids=["serial", "async"])
def test_a_small_wave_gets_its_first_tokens_together(in_flight: int) -> None:
    """Four streams of 384-token prompts (3 steps a wave): the prompts that end before
    their wave's last step keep their last token for it, so the wave's first tokens come
    in one answer and no stream waits between its first two tokens. At an idle engine the
    first request of a wave is scheduled alone (nothing else has arrived): it alone may
    wait once, for the rest of its wave."""
    sched = make(num_blocks=4000, budget=None)
    mixed, _, answers = serve_streams(sched, 4, 12, 384, 24, in_flight)
    assert not any(mixed), [i for i, m in enumerate(mixed) if m]
    waited = {r for r, a in answers.items() if any(y - x > 1 for x, y in itertools.pairwise(a))}
    firsts = [{answers[f"w{i}"][0] for i in range(k, k + 4)} for k in (0, 4, 8)]
    assert len(firsts[0]) == 1 and not waited & {f"w{i}" for i in range(4)}, answers
    for k in (4, 8):  # later waves: the one scheduled alone, then the other three
        assert len({answers[f"w{i}"][0] for i in range(k + 1, k + 4)}) == 1, answers
        assert waited & {f"w{i}" for i in range(k, k + 4)} <= {f"w{k}"}, answers
    assert all(len(a) == 24 for a in answers.values())


def test_established_streams_never_wait_for_a_prompt() -> None:
    """A prompt arriving beside streams past their first tokens: they decode beside its
    chunks under the cap, in every step (only fresh streams wait, once)."""
    sched = make(num_blocks=4000, budget=None)
    for i in range(3):
        add(sched, f"d{i}", 384, 40)
    while any(r.num_output_tokens <= FRESH_TOKENS for r in sched.requests.values()):
        step(sched)
    add(sched, "late", 384, 4)
    while sched.requests["late"].num_computed_tokens < 384:
        so, _ = step(sched)
        assert all(scheduled(so).get(f"d{i}") == 1 for i in range(3)), scheduled(so)


def test_a_fresh_stream_waits_once_and_at_most_the_hold() -> None:
    """A burst too large to wait for whole (32 prompts of 1024 tokens: 64 full steps): the
    first streams decode beside the chunks under the cap until the rest of the burst fits
    WAVE_HOLD_STEPS steps, then the fresh ones wait, at most that many steps and once; no
    stream's tokens are ever further apart."""
    sched = make(num_blocks=12000, budget=None, max_num_seqs=32)
    for i in range(32):
        add(sched, f"r{i}", 1024, 8)
    last: dict[str, int] = {}
    gaps: dict[str, list[int]] = {}
    k = 0
    while sched.has_unfinished_requests():
        k += 1
        _, outs = step(sched)
        for out in outs:
            if out.request_id in last:
                gaps.setdefault(out.request_id, []).append(k - last[out.request_id])
            last[out.request_id] = k
    assert len(last) == 32
    longest = max(max(g) for g in gaps.values())
    assert 1 < longest <= WAVE_HOLD_STEPS + 1, gaps
    assert all(sum(g > 1 for g in gs) <= 1 for gs in gaps.values()), gaps
    # The burst's first request started decoding before the hold could cover the rest.
    assert gaps["r0"][0] == 1, gaps["r0"]
