"""The stored responses: the most recent kept, within a count and a byte budget
(responses_store.py), and a server's memory bounded by that budget."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.cli_flags import build_parser
from launch.openai.responses_store import ResponseStore, StoredResponse, stored_size
from tests.helpers.proc_memory import rss_bytes
from tests.helpers.server import MODEL_NAME, Server, post, start_server


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
    assert not empty.put("x", StoredResponse({}, []))
    assert empty.get("x") is None
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        ResponseStore(-1)
    with pytest.raises(ValueError, match="byte budget must be >= 1"):
        ResponseStore(1, 0)


def _big(i: int, n: int) -> StoredResponse:
    return StoredResponse({"id": str(i)}, [{"role": "user", "content": "x" * n}])


def test_the_byte_budget_drops_the_oldest_and_refuses_one_response_over_it() -> None:
    one = stored_size(_big(0, 1000))
    assert 1000 < one < 2000  # its JSON, plus a fixed cost per message
    store = ResponseStore(100, 3 * one)
    for i in range(5):
        assert store.put(str(i), _big(i, 1000))
    assert [store.get(str(i)) is not None for i in range(5)] == [False, False, True, True, True]
    assert store.num_bytes == 3 * one
    # Alone over the whole budget: not kept, and nothing else is dropped for it.
    assert not store.put("huge", _big(9, 3 * one))
    assert store.get("huge") is None and len(store) == 3
    # Stored again under the same id: the old copy no longer counts.
    assert store.put("4", _big(4, 1000)) and store.num_bytes == 3 * one
    assert store.delete("2") and store.num_bytes == 2 * one
    # A response too large to store replaces nothing: an old one under its id is gone.
    assert not store.put("3", _big(3, 3 * one)) and store.get("3") is None
    assert store.num_bytes == one


def test_the_byte_budget_flag_takes_units_and_refuses_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).responses_store_bytes == 256 * 2**20
    assert parse(["serve", "--responses-store-bytes", "64MiB"]).responses_store_bytes == 2**26
    with pytest.raises(SystemExit):
        parse(["serve", "--responses-store-bytes", "0"])
    assert "--responses-store-bytes must be a whole number of bytes >= 1" in capsys.readouterr().err


ITEM_BYTES = 5_000_000
BUDGET = 12 * 2**20  # two responses with a 5 MB item each


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        chat_model,
        tmp_path_factory.mktemp("store"),
        "--responses-store-bytes",
        f"{BUDGET // 2**20}MiB",
    )
    yield s
    s.stop()


def _stored(server: Server, response_id: str) -> bool:
    """Whether GET /v1/responses/{id} finds it (200) rather than not (404)."""
    try:
        with urllib.request.urlopen(f"{server.url}/v1/responses/{response_id}", timeout=60):
            return True
    except urllib.error.HTTPError as e:
        assert e.code == 404, e.read()
        return False


def _respond(server: Server, filler: int, **extra: object) -> dict:
    """A response whose input carries `filler` bytes the model never reads (an earlier
    answer's reasoning item: kept among the input items, left out of the prompt)."""
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r" * filler}]}
    body = {
        "model": MODEL_NAME,
        "input": [thought, {"role": "user", "content": "What is 2 + 2 ?"}],
        "max_output_tokens": 2,
        "temperature": 0,
        **extra,
    }
    status, answer = post(f"{server.url}/v1/responses", body)
    assert status == 200, answer
    return answer


def test_stored_responses_with_huge_inputs_leave_the_server_within_its_budget(
    server: Server,
) -> None:
    """30 responses with a 5 MB input item each: the server keeps the newest that fit its
    12 MiB budget and grows by far less than the 150 MB it would hold without one."""
    _respond(server, 1000)
    before = rss_bytes(server.proc.pid)
    ids = [_respond(server, ITEM_BYTES)["id"] for _ in range(30)]
    grown = rss_bytes(server.proc.pid) - before
    assert grown < 60 * 2**20, f"the server grew by {grown / 2**20:.0f} MB"
    kept = [_stored(server, i) for i in ids]
    assert kept == [False] * 28 + [True] * 2  # the oldest dropped first


def test_a_response_over_the_whole_budget_is_answered_but_not_stored(server: Server) -> None:
    answer = _respond(server, BUDGET + 1)
    assert answer["status"] in ("completed", "incomplete") and answer["store"] is False
    assert not _stored(server, answer["id"])
    status, error = post(
        f"{server.url}/v1/responses",
        {"model": MODEL_NAME, "input": "And 3", "previous_response_id": answer["id"]},
    )
    assert status == 400 and error["error"]["code"] == "previous_response_not_found"
    # Smaller ones are stored as before.
    small = _respond(server, 1000)
    assert small["store"] is True
    assert _stored(server, small["id"])
