"""Scheduling policies: the waiting queue in arrival order (fcfs) or by each request's
priority, lower first, ties by arrival (priority); preemption takes the last running
request in that order. Checked on the real Scheduler against a sort of the requests by
(priority, arrival), and through the real processes."""

from __future__ import annotations

import os
import random
import time

import pytest

from enginecore.kv_cache_config import with_num_blocks
from enginecore.request import Request
from enginecore.request_queue import FCFSQueue, PriorityQueue, make_request_queue
from enginecore.scheduler import Scheduler
from launch import LLM, Prompt
from launch.client.async_llm import AsyncLLM
from launch.client.async_llm import run as run_async
from launch.client.builtin_model import builtin_model_dir
from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineProcesses
from protocol.engine import SamplingParams
from protocol.kv_cache import KVCacheGroupSpec
from protocol.worker import ModelRunnerOutput, SchedulerOutput
from tests.helpers.cli_helpers import CPU
from tests.helpers.kv_helpers import full, sched_config

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
VOCAB = 100
TOKEN = 7


def scheduler(policy: str, num_blocks: int = 200, max_num_seqs: int = 2) -> Scheduler:
    config = sched_config(
        256, max_num_batched_tokens=256, max_num_seqs=max_num_seqs, scheduling_policy=policy
    )
    groups = [KVCacheGroupSpec(["l0"], full())]
    return Scheduler(config, with_num_blocks(groups, num_blocks), VOCAB)


def add(sched: Scheduler, rid: str, n: int, max_tokens: int, priority: int = 0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = sched.new_request(rid, [5] * n, params, priority=priority)
    return sched.add_request(req)


def step(sched: Scheduler) -> tuple[SchedulerOutput, list]:
    """One serial step, every due request sampling TOKEN; the step and its outputs."""
    so = sched.schedule()
    if not so.total_num_scheduled_tokens:
        return so, []  # nothing to run: the core sends the workers no step
    rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
    due = [r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
    outs = sched.update_from_output(so, ModelRunnerOutput(so.step_id, due, [TOKEN] * len(due)))
    sched.check_invariants()
    return so, outs


def admissions(sched: Scheduler) -> list[str]:
    """Step to the end; request ids in the order they were first admitted."""
    order: list[str] = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        order += [r.req_id for r in so.new_reqs]
    return order


def test_priority_admits_the_lowest_value_first_and_ties_in_arrival_order() -> None:
    arrivals = [("a", 5), ("b", 1), ("c", 1), ("d", 0), ("e", 5), ("f", -3)]
    by_priority = scheduler("priority", max_num_seqs=1)
    fcfs = scheduler("fcfs", max_num_seqs=1)
    for rid, priority in arrivals:
        assert add(by_priority, rid, 6, 3, priority) is None
        assert add(fcfs, rid, 6, 3) is None
    assert admissions(by_priority) == ["f", "d", "b", "c", "a", "e"]
    assert admissions(fcfs) == ["a", "b", "c", "d", "e", "f"]


def test_every_admission_takes_the_best_ranked_waiting_requests() -> None:
    """Requests arrive between steps with random priorities; each step must admit the
    best (priority, arrival) of those waiting, as many as free seats allow."""
    rng = random.Random(7)
    sched = scheduler("priority", max_num_seqs=3)
    rank: dict[str, tuple[int, int]] = {}
    waiting: set[str] = set()
    arrived = 0
    for _ in range(120):
        for _ in range(rng.randrange(3)):
            rid = f"r{arrived}"
            priority = rng.randrange(-2, 3)
            assert add(sched, rid, rng.randrange(1, 20), rng.randrange(1, 6), priority) is None
            rank[rid] = (priority, arrived)
            waiting.add(rid)
            arrived += 1
        seats = 3 - len(sched.running)
        so, _ = step(sched)
        admitted = [r.req_id for r in so.new_reqs]
        expected = sorted(waiting, key=rank.__getitem__)[:seats]
        assert admitted == expected
        waiting -= set(admitted)
    assert arrived > 100


@pytest.mark.parametrize(
    ("policy", "priorities", "want"),
    [
        # B waits until its whole recompute fits beside A, then is admitted ahead of C.
        ("fcfs", (0, 0, 0), ("B", "same step")),
        ("priority", (2, 1, 0), ("A", "C first")),
        # The victim outranks C, or ties it and arrived first: it goes back ahead of C
        # (in the same step: it waits for room beside A, and C for it).
        ("priority", (0, 1, 2), ("B", "same step")),
        ("priority", (0, 1, 1), ("B", "same step")),
    ],
    ids=["fcfs", "victim-ranks-last", "victim-outranks", "victim-ties-older"],
)
def test_priority_preempts_the_lowest_priority_and_readmits_it_in_rank_order(
    policy: str, priorities: tuple[int, int, int], want: tuple[str, str]
) -> None:
    """A runs, then B joins it, then C waits for a seat; A and B outgrow a pool that holds
    one of them. fcfs preempts B (the last to arrive) and readmits it no later than C (a
    preempted request arrived before everyone waiting); priority preempts the lowest
    ranked running request (A at 2 against B at 1, though B joined later) and readmits it
    in rank order with C (priority, then arrival)."""
    # 9 blocks of 4 tokens (8 usable); A and B each grow to 8 + 20 tokens, 7 blocks.
    sched = scheduler(policy, num_blocks=9)
    steps: list[SchedulerOutput] = []
    for (rid, n, max_tokens), priority in zip(
        (("A", 8, 20), ("B", 8, 20), ("C", 4, 2)), priorities
    ):
        assert add(sched, rid, n, max_tokens, priority) is None
        steps.append(step(sched)[0])
    finished: list[str] = []
    while sched.has_unfinished_requests():
        so, outs = step(sched)
        steps.append(so)
        finished += [o.request_id for o in outs if o.finish_reason == "length"]
    assert sorted(finished) == ["A", "B", "C"]
    first = next(i for i, so in enumerate(steps) if so.preempted_req_ids)
    (victim,) = steps[first].preempted_req_ids
    back = next(i for i, so in enumerate(steps) if i > first and victim in so.cached_reqs.req_ids)
    c_in = next(i for i, so in enumerate(steps) if "C" in [r.req_id for r in so.new_reqs])
    assert c_in > first  # C waited for a seat until after the preemption
    order = "victim first" if back < c_in else "C first" if c_in < back else "same step"
    assert (victim, order) == want


def test_a_priority_under_fcfs_fails_alone() -> None:
    sched = scheduler("fcfs")
    error = add(sched, "urgent", 4, 2, priority=2)
    assert error is not None and error.finish_reason == "error"
    assert "priority 2 needs the priority scheduling policy" in error.error
    assert add(sched, "plain", 4, 2) is None
    assert admissions(sched) == ["plain"]
    not_int = sched.new_request("x", [5], SamplingParams(max_tokens=1), priority="high")  # type: ignore[arg-type]
    assert "priority must be an integer" in sched.add_request(not_int).error


def test_the_queues_keep_their_order_through_removals() -> None:
    reqs = [Request(f"r{i}", [1]) for i in range(6)]
    for i, (r, p) in enumerate(zip(reqs, [2, 0, 1, 0, 2, 1])):
        r.priority, r.arrival = p, i
    by_priority, fcfs = make_request_queue("priority"), make_request_queue("fcfs")
    assert isinstance(by_priority, PriorityQueue) and isinstance(fcfs, FCFSQueue)
    for r in reqs:
        by_priority.add(r)
        fcfs.add(r)
    assert [r.request_id for r in by_priority] == ["r1", "r3", "r2", "r5", "r0", "r4"]
    by_priority.remove(reqs[3])
    by_priority.remove_ids({"r2"})
    fcfs.remove_ids({"r2", "r3"})
    assert [r.request_id for r in fcfs] == ["r0", "r1", "r4", "r5"]
    assert by_priority.pop_head() is reqs[1] and by_priority.peek() is reqs[5]
    by_priority.add_preempted(reqs[1])  # back where its own key puts it: the head
    fcfs.add_preempted(reqs[5])  # back at the head, ahead of every arrival
    assert by_priority.peek() is reqs[1] and fcfs.peek() is reqs[5]
    by_priority.pop_head()
    by_priority.add_preempted(reqs[1])
    by_priority.remove(reqs[0])
    by_priority.add_preempted(reqs[0])  # ranked last: it does not jump the queue
    assert [r.request_id for r in by_priority] == ["r1", "r5", "r0", "r4"]
    assert [by_priority.pop_head().request_id for _ in range(2)] == ["r1", "r5"]
    by_priority.add(reqs[1])
    assert len(by_priority) == 3 and len(fcfs) == 5
    with pytest.raises(ValueError, match="fcfs or priority"):
        make_request_queue("lifo")  # type: ignore[arg-type]


def test_priority_through_the_real_processes() -> None:
    """One seat, held by a request that runs until aborted; four requests arrive while
    it runs, then the abort (the same socket, so after them): they must run in priority
    order. Under fcfs the launcher refuses a priority and the core too."""
    args = EngineArgs(
        model=str(builtin_model_dir()), device=CPU, max_num_seqs=1, scheduling_policy="priority"
    )
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    with EngineProcesses(args) as engine:
        engine.add_request(
            "blocker", [11, 12, 13], SamplingParams(max_tokens=4000, ignore_eos=True)
        )
        first_token: list[str] = []
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + 600  # only so that a broken engine cannot hang CI
        sent = False
        while len(reasons) < 5 and time.monotonic() < deadline:
            batch = engine.get_outputs()
            if batch is None:
                continue
            for o in batch.outputs:
                if o.new_token_ids and o.request_id not in first_token:
                    first_token.append(o.request_id)
                if o.finish_reason:
                    reasons[o.request_id] = o.finish_reason
            if not sent and "blocker" in first_token:
                for rid, priority in (("p5", 5), ("p1a", 1), ("p1b", 1), ("p0", 0)):
                    engine.add_request(rid, [21, 22, 23, 24], short, priority=priority)
                engine.abort(["blocker"])
                sent = True
        assert reasons == {"blocker": "abort"} | dict.fromkeys(("p5", "p1a", "p1b", "p0"), "length")
        assert first_token == ["blocker", "p0", "p1a", "p1b", "p5"]
    with LLM(str(builtin_model_dir()), device=CPU) as llm:  # fcfs, the default
        outs = llm.generate(
            [Prompt(prompt_token_ids=[1, 2], priority=4), [1, 2], [3]], short, use_tqdm=False
        )
        assert outs[0].finish_reason == "error" and "--scheduling-policy priority" in outs[0].error
        assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3
        # One priority per prompt overrides the Prompt's: 0 is served under fcfs.
        outs = llm.generate(
            [Prompt(prompt_token_ids=[1, 2], priority=4), [3]],
            short,
            use_tqdm=False,
            priority=[0, 1],
        )
        assert outs[0].finish_reason == "length" and "priority 1 needs" in outs[1].error
        with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
            llm.generate([[1], [2]], short, use_tqdm=False, priority=[0])
        # Past the launcher's check, straight to the core: it refuses the same way.
        llm.engine.add_request("raw", [1, 2], short, priority=4)
        done: list = []
        deadline = time.monotonic() + 600
        while not done and time.monotonic() < deadline:
            batch = llm.engine.get_outputs()
            done = [o for o in (batch.outputs if batch else []) if o.request_id == "raw"]
        assert done[0].finish_reason == "error" and "priority 4 needs" in done[0].error


def test_async_llm_sends_a_priority_and_refuses_one_its_policy_cannot_serve() -> None:
    short = SamplingParams(max_tokens=2, ignore_eos=True)

    async def tokens(engine: AsyncLLM, **kwargs: int) -> list[int]:
        return [
            t async for out in engine.generate([5, 6], short, **kwargs) for t in out.new_token_ids
        ]

    async def main() -> None:
        for policy in ("fcfs", "priority"):
            engine = await AsyncLLM.create(
                str(builtin_model_dir()), device=CPU, scheduling_policy=policy
            )
            try:
                assert len(await tokens(engine)) == 2
                if policy == "priority":
                    assert len(await tokens(engine, priority=-1)) == 2
                else:
                    with pytest.raises(ValueError, match="priority -1 needs the priority"):
                        engine.generate([5, 6], short, priority=-1)
                with pytest.raises(ValueError, match="priority must be an integer"):
                    engine.generate([5, 6], short, priority=1.5)  # type: ignore[arg-type]
            finally:
                engine.shutdown()

    run_async(main())
