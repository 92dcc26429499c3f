"""The pool's capacity, at start and at admission: a request that can never fit fails at
once and alone, and the requests around it run exactly as they would without it."""

from __future__ import annotations

import pytest

from enginecore.kv_cache_config import with_num_blocks
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from protocol.engine import SamplingParams
from protocol.kv_cache import KVCacheGroupSpec
from protocol.worker import ModelRunnerOutput
from tests.helpers.kv_helpers import full, sched_config, window

VOCAB = 100


def scheduler(num_blocks: int, *specs, max_model_len: int = 64, chunk: int = 64) -> Scheduler:
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs or (full(),))]
    config = sched_config(max_model_len, max_num_batched_tokens=chunk, max_num_seqs=8)
    return Scheduler(config, with_num_blocks(groups, num_blocks), VOCAB)


def run(sched: Scheduler, prompts: dict[str, tuple[int, int]]) -> tuple[dict, dict[str, int]]:
    """Add (prompt length, max_tokens) requests, step to the end sampling token 7; the
    error outputs of add_request, and the step at which each request finished."""
    errors = {}
    for rid, (n, max_tokens) in prompts.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(rid, [5] * n, sched.kv_cache_manager.block_hasher, sampling_params=params)
        out = sched.add_request(req)
        if out is not None:
            errors[rid] = out
    finished: dict[str, int] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        rids = [r.req_id for r in so.new_reqs] + list(so.cached_reqs.req_ids)
        due = [
            r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
        ]
        out = ModelRunnerOutput(so.step_id, due, [7] * len(due))
        for o in sched.update_from_output(so, out):
            if o.finish_reason:
                finished[o.request_id] = so.step_id
    return errors, finished


def test_a_request_that_can_never_fit_fails_at_once_and_alone() -> None:
    # 8 blocks of 4 tokens, 7 usable (28 tokens); L needs 40 + 4 tokens: 11 blocks.
    with_l = scheduler(8)
    errors, finished = run(with_l, {"A": (20, 4), "L": (40, 4), "C": (4, 4)})
    assert set(errors) == {"L"} and errors["L"].finish_reason == "error"
    assert "44 tokens (prompt + max_tokens) need 11 blocks, the cache has 7" in errors["L"].error
    without_l = scheduler(8)
    _, alone = run(without_l, {"A": (20, 4), "C": (4, 4)})
    assert finished == alone  # nobody waited or was preempted for L
    assert with_l.num_preemptions == without_l.num_preemptions


def test_max_tokens_is_capped_at_max_model_len_before_judging() -> None:
    # 24 tokens fit (6 blocks of 7); prompt 10 + max_tokens 1000 is capped at 24.
    errors, finished = run(scheduler(8, max_model_len=24), {"A": (10, 1000)})
    assert not errors and "A" in finished


@pytest.mark.parametrize(
    ("specs", "chunk", "blocks"),
    [
        ((full(),), 64, 16),  # 64 tokens / 4
        ((window(8),), 64, 16),  # the window plus a 64-token chunk covers everything
        ((window(8),), 4, 4),  # ceil((8 - 1 + 4) / 4) + 1
        ((full(), window(8)), 4, 20),  # groups share the pool: their needs add up
    ],
)
def test_start_refuses_a_pool_that_cannot_hold_max_model_len(specs, chunk: int, blocks: int):
    fits = scheduler(blocks + 1, *specs, chunk=chunk)
    fits.check_capacity()
    short = scheduler(blocks, *specs, chunk=chunk)
    with pytest.raises(
        ValueError,
        match=f"holds {blocks - 1} blocks, but one request of "
        f"max_model_len 64 tokens needs {blocks}",
    ):
        short.check_capacity()
