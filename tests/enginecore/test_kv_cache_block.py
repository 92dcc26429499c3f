"""FreeKVCacheBlockQueue against a plain list model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from enginecore import FreeKVCacheBlockQueue, KVCacheBlock
from enginecore.errors import InvariantViolation

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["popleft", "popleft_n", "remove", "append", "appendleft", "prepend_n"]),
        st.integers(0, 10),
    ),
    max_size=60,
)


@given(_OPS)
def test_queue_matches_a_list(ops: list[tuple[str, int]]) -> None:
    blocks = [KVCacheBlock(i) for i in range(10)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(10))
    for op, arg in ops:
        out = [i for i in range(10) if i not in model]
        if op == "popleft" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "popleft_n":
            n = min(arg, len(model))
            assert [b.block_id for b in q.popleft_n(n)] == model[:n]
            del model[:n]
        elif op == "remove" and model:
            victim = model[arg % len(model)]
            q.remove(blocks[victim])
            model.remove(victim)
        elif op == "append" and out:
            q.append(blocks[out[arg % len(out)]])
            model.append(out[arg % len(out)])
        elif op == "appendleft" and out:
            q.appendleft(blocks[out[arg % len(out)]])
            model.insert(0, out[arg % len(out)])
        elif op == "prepend_n":
            chosen = out[: arg % (len(out) + 1)]
            q.prepend_n([blocks[i] for i in chosen])
            model[:0] = chosen
        assert q.block_ids() == model
        assert len(q) == len(model)
        for i in range(10):
            assert (blocks[i].prev_free is not None) == (i in model)


def test_misuse_is_refused() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(InvariantViolation, match="already in the free queue"):
        q.append(blocks[0])
    q.popleft_n(3)
    with pytest.raises(InvariantViolation, match="no free KV cache blocks"):
        q.popleft()
    with pytest.raises(InvariantViolation, match="not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="asked for 1"):
        q.popleft_n(1)
