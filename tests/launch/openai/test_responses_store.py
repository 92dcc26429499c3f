"""The stored responses: the most recent kept (responses_store.py)."""

from __future__ import annotations

import pytest

from launch.openai.responses_store import ResponseStore, StoredResponse


def test_the_store_keeps_the_most_recent() -> None:
    store = ResponseStore(2)
    for i in range(3):
        store.put(str(i), StoredResponse({"id": str(i)}, []))
    assert store.get("0") is None and len(store) == 2
    store.put("1", StoredResponse({"id": "1"}, []))  # stored again: the newest now
    store.put("3", StoredResponse({"id": "3"}, []))
    assert store.get("2") is None and store.get("1") is not None
    assert store.delete("1") and not store.delete("1")
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, []))
    assert empty.get("x") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)
