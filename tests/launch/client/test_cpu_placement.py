"""--cpu-placement on a real engine: reserve pins the worker's threads to cores of its own
and the engine core to the rest, leaves an embedding program's own affinity alone, and
gives the same tokens as shared, which pins nothing."""

from __future__ import annotations

import os
from pathlib import Path

from launch import LLM, SamplingParams
from protocol.cpu_placement import plan_cpus, thread_ids, usable_cpus
from tests.helpers.cli_helpers import CPU

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[11, 12, 13], [7] * 40, list(range(3, 90))]


def _masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(tid)) for tid in thread_ids(pid)}


def test_reserve_pins_worker_and_core_and_shared_pins_nothing(chat_model: Path) -> None:
    ours = frozenset(usable_cpus())
    plan = plan_cpus(usable_cpus(), 1, 1)
    with LLM(str(chat_model), device=CPU, cpu_placement="reserve") as llm:
        procs = llm.engine.procs
        if plan is None:  # one core: nothing to keep apart, every process shares it
            assert _masks(procs["worker rank 0"].pid) == {ours}
        else:
            assert _masks(procs["worker rank 0"].pid) == {frozenset(plan.workers[0])}
            assert _masks(procs["engine core"].pid) == {frozenset(plan.front)}
        assert _masks(os.getpid()) == {ours}  # the embedding program keeps its cores
        reserved = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(chat_model), device=CPU, cpu_placement="shared") as llm:
        for name in ("worker rank 0", "engine core"):
            assert _masks(llm.engine.procs[name].pid) == {ours}
        shared = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert reserved == shared and all(len(t) == 12 for t in reserved)
