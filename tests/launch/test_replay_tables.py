"""launch/replay_tables.py: the block tables a recording's SchedulerOutputs imply, checked
step by step against a hand-kept table, and every contradiction named."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from launch.replay_tables import CoreBlockTables, ReplayMismatch
from protocol.engine import SamplingParams
from protocol.kv_cache import NULL_BLOCK_ID
from protocol.worker import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK = 4


def _new(req_id: str, block_ids: list[list[int]], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, [1] * 8, SamplingParams(), block_ids, computed)


def _step(
    step: int,
    new: Sequence[NewRequestData] = (),
    cached: Sequence[tuple[str, list[list[int]] | None, bool, list[int] | None]] = (),
    finished: Sequence[str] = (),
    preempted: Sequence[str] = (),
) -> SchedulerOutput:
    """cached: (req_id, new block ids, resumed, num_skipped_blocks) per running request."""
    rows = CachedRequestData(
        [c[0] for c in cached],
        [c[1] for c in cached],
        [0] * len(cached),
        [c[2] for c in cached],
        [c[3] for c in cached],
    )
    n = len(new) + len(cached)
    return SchedulerOutput(step, list(new), rows, [1] * n, n, list(finished), list(preempted))


def test_tables_grow_lose_a_window_prefix_and_drop_finished_requests() -> None:
    tables = CoreBlockTables([BLOCK, BLOCK])
    tables.apply(_step(0, new=[_new("a", [[1, 2], [3]]), _new("b", [[4], [5]])]))
    assert tables.tables == {"a": [[1, 2], [3]], "b": [[4], [5]]}
    tables.apply(_step(1, cached=[("a", [[6], []], False, [0, 1]), ("b", None, False, None)]))
    assert tables.tables == {"a": [[1, 2, 6], [NULL_BLOCK_ID]], "b": [[4], [5]]}
    tables.apply(_step(2, finished=["b"], cached=[("a", None, False, [2, 1])]))
    assert tables.tables == {"a": [[NULL_BLOCK_ID, NULL_BLOCK_ID, 6], [NULL_BLOCK_ID]]}
    tables.compare(2, 0, {"a": [[0, 0, 6], [0]]})


def test_a_resumed_request_takes_its_full_new_table_and_may_reuse_freed_blocks() -> None:
    tables = CoreBlockTables([BLOCK])
    tables.apply(_step(0, new=[_new("a", [[1, 2]]), _new("b", [[3]])]))
    tables.apply(_step(1, preempted=["a"], cached=[("b", [[1]], False, None)]))
    assert tables.tables == {"b": [[3, 1]]}
    tables.apply(_step(2, preempted=["b"], cached=[("a", [[3, 1, 2]], True, None)]))
    assert tables.tables == {"a": [[3, 1, 2]]}


def test_a_prefix_hit_may_share_blocks_but_a_new_block_may_not_be_held() -> None:
    tables = CoreBlockTables([BLOCK])
    tables.apply(_step(0, new=[_new("a", [[1, 2]])]))
    tables.apply(_step(1, new=[_new("b", [[1, 5]], computed=BLOCK)]))  # block 1 a hit
    with pytest.raises(ReplayMismatch, match="step 2, request 'c', KV cache group 0") as info:
        tables.apply(_step(2, new=[_new("c", [[1]])]))  # block 1 as new while held
    assert "block 1 as new while request 'a' still holds it" in str(info.value)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (_step(1, cached=[("ghost", None, False, None)]), "'ghost' continues but"),
        (_step(1, cached=[("a", None, True, None)]), "resumed request 'a' comes without"),
        (_step(1, new=[_new("b", [[7], [8]])]), "block ids for 2 KV cache groups"),
    ],
)
def test_a_step_that_contradicts_the_recording_is_named(
    step: SchedulerOutput, message: str
) -> None:
    tables = CoreBlockTables([BLOCK])
    tables.apply(_step(0, new=[_new("a", [[1]])]))
    with pytest.raises(ReplayMismatch, match=f"step 1.*{message}"):
        tables.apply(step)


def test_compare_names_the_request_group_and_both_rows() -> None:
    tables = CoreBlockTables([BLOCK, BLOCK])
    tables.apply(_step(0, new=[_new("a", [[1], [2, 3]])]))
    tables.compare(0, 1, {"a": [[1], [2, 3]]})
    with pytest.raises(ReplayMismatch) as info:
        tables.compare(0, 1, {"a": [[1], [2, 4]]})
    assert str(info.value) == (
        "step 0, request 'a', KV cache group 1: worker rank 1's block table row is [2, 4], "
        "the core assigned [2, 3]"
    )
    with pytest.raises(ReplayMismatch, match=r"requests the core does not run: \['z'\].*\['a'\]"):
        tables.compare(0, 1, {"z": [[1], [2, 3]]})
