"""A consumer slower than the engine: RequestStream hands it, per sequence, everything
that arrived meanwhile as one output, and loses, repeats or reorders nothing.

No engine here: the outputs the reader task would dispatch are put in the stream's inbox
by hand, all before the consumer reads (the engine ran ahead), or one at a time (a
consumer keeping up).
"""

from __future__ import annotations

import asyncio

import pytest

from launch.client.output_processor import SequenceState, fan_out
from launch.client.request_stream import RequestStream, StreamOutput
from launch.client.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from protocol.engine import Logprobs, RequestOutput, SamplingParams
from tests.helpers.model_files import word_tokenizer


class FakeEngine:
    """What a stream calls back into: which core requests it aborted or let go."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.forgotten: list[str] = []

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def open_stream(tok: Tokenizer, params: SamplingParams) -> tuple[RequestStream, FakeEngine]:
    engine = FakeEngine()
    sequences = {c: SequenceState(tok, params, text=True) for c, _ in fan_out("r", params)}
    return RequestStream(engine, "r", [[1, 2]], sequences), engine  # type: ignore[arg-type]


def outputs(core_id: str, ids: list[int], lps: bool = False) -> list[RequestOutput]:
    """One output per token, as the core sends a decode; the last one finishes."""
    return [
        RequestOutput(
            core_id,
            [t],
            "length" if i == len(ids) - 1 else None,
            num_cached_tokens=16,
            logprobs=[Logprobs(-0.5 * i, [t], [-0.5 * i])] if lps else None,
        )
        for i, t in enumerate(ids)
    ]


def read_all(stream: RequestStream) -> list[StreamOutput]:
    async def main() -> list[StreamOutput]:
        return [out async for out in stream]

    return asyncio.run(main())


TEXT = "añ€😀 ok, done"
IDS = list(TEXT.encode())  # ByteTokenizer: characters of 1-4 tokens


def test_a_slow_consumer_gets_everything_queued_as_one_output_equal_to_a_fast_one() -> None:
    params = SamplingParams(max_tokens=len(IDS), logprobs=1)
    fast, _ = open_stream(ByteTokenizer(), params)
    fast_outs: list[StreamOutput] = []

    async def keep_up() -> None:
        for o in outputs("r", IDS, lps=True):
            fast.inbox.put(o)
            fast_outs.append(await fast.__anext__())

    asyncio.run(keep_up())
    slow, engine = open_stream(ByteTokenizer(), params)
    for o in outputs("r", IDS, lps=True):
        slow.inbox.put(o)
    (out,) = read_all(slow)
    assert out.new_token_ids == IDS == [t for o in fast_outs for t in o.new_token_ids]
    assert out.text == TEXT == "".join(o.text for o in fast_outs)
    assert out.logprobs == [lp for o in fast_outs for lp in o.logprobs or []]
    assert [lp.top_token_ids[0] for lp in out.logprobs or []] == IDS  # in order
    assert (out.finish_reason, out.num_output_tokens, out.num_cached_tokens) == (
        "length",
        len(IDS),
        16,
    )
    assert engine.forgotten == ["r"] and engine.aborted == []


def test_n_sequences_interleaved_are_merged_each_apart_in_order() -> None:
    stream, _ = open_stream(ByteTokenizer(), SamplingParams(max_tokens=3, n=2))
    a, b = outputs("r-0", list(b"abc")), outputs("r-1", list(b"xyz"))
    for pair in zip(a, b):
        for o in pair:
            stream.inbox.put(o)
    outs = read_all(stream)
    assert [(o.index, o.text, o.finish_reason) for o in outs] == [
        (0, "abc", "length"),
        (1, "xyz", "length"),
    ]


@pytest.fixture
def words(tmp_path) -> HFTokenizer:
    word_tokenizer(tmp_path)
    return HFTokenizer(tmp_path / "tokenizer.json")


def test_a_stop_string_ends_a_sequence_and_drops_what_the_core_sent_after_it(
    words: HFTokenizer,
) -> None:
    ids = words.encode("What is 2 + 2 ? You are terse", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=["? You"], n=2)
    stream, engine = open_stream(words, params)
    # The engine ran on past the stop string in copy 0 before the consumer read.
    for a, b in zip(outputs("r-0", ids), outputs("r-1", ids[:3] + [ids[0]] * (len(ids) - 3))):
        stream.inbox.put(a)
        stream.inbox.put(b)
    outs = read_all(stream)
    by_index = {o.index: o for o in outs}
    assert len(outs) == 2  # one output per sequence: each was all queued
    assert by_index[0].text == "What is 2 + 2 " and by_index[0].finish_reason == "stop"
    assert by_index[0].stop_reason == "? You"
    assert by_index[0].new_token_ids == ids[: ids.index(words.encode("You")[-1]) + 1]
    assert by_index[1].finish_reason == "length"
    assert engine.aborted == ["r-0"] and engine.forgotten == ["r-1"]


def test_an_error_after_queued_outputs_comes_after_them() -> None:
    stream, _ = open_stream(ByteTokenizer(), SamplingParams(max_tokens=10))
    for o in outputs("r", list(b"hello"))[:-1]:
        stream.inbox.put(o)
    stream.inbox.put(RuntimeError("engine died"))

    async def main() -> tuple[StreamOutput, BaseException]:
        first = await stream.__anext__()
        with pytest.raises(RuntimeError) as e:
            await stream.__anext__()
        return first, e.value

    first, error = asyncio.run(main())
    assert first.text == "hell" and first.finish_reason is None
    assert str(error) == "engine died" and stream.finished


def keeping_up(stream: RequestStream, outs: list[RequestOutput]) -> list[StreamOutput]:
    """A consumer that reads whenever the inbox wakes it, one engine output at a time."""
    got: list[StreamOutput] = []

    async def main() -> None:
        for o in outs:
            stream.inbox.put(o)
            while stream.inbox.ready:
                got.append(await stream.__anext__())

    asyncio.run(main())
    return got


def test_a_stream_interval_wakes_the_consumer_every_n_tokens_but_first_and_last() -> None:
    params = SamplingParams(max_tokens=len(IDS), logprobs=1)
    every, _ = open_stream(ByteTokenizer(), params)
    assert [len(o.new_token_ids) for o in keeping_up(every, outputs("r", IDS))] == [1] * len(IDS)
    engine = FakeEngine()
    sequences = {"r": SequenceState(ByteTokenizer(), params, text=True)}
    stream = RequestStream(engine, "r", [[1, 2]], sequences, stream_interval=4)  # type: ignore[arg-type]
    got = keeping_up(stream, outputs("r", IDS, lps=True))
    sizes = [len(o.new_token_ids) for o in got]
    # The first token at once, then four at a time, the rest with the finish.
    rest = (len(IDS) - 1) % 4 or 4
    assert sizes == [1] + [4] * ((len(IDS) - 1 - rest) // 4) + [rest], sizes
    assert [t for o in got for t in o.new_token_ids] == IDS
    assert "".join(o.text for o in got) == TEXT
    assert [lp.top_token_ids[0] for o in got for lp in o.logprobs or []] == IDS
    assert got[-1].finish_reason == "length" and engine.forgotten == ["r"]


def test_a_stream_interval_counts_each_sequence_apart() -> None:
    params = SamplingParams(max_tokens=9, n=2)
    engine = FakeEngine()
    sequences = {
        c: SequenceState(ByteTokenizer(), params, text=True) for c, _ in fan_out("r", params)
    }
    stream = RequestStream(engine, "r", [[1, 2]], sequences, stream_interval=3)  # type: ignore[arg-type]
    a, b = outputs("r-0", list(b"abcdefghi")), outputs("r-1", list(b"rstuvwxyz"))
    got = keeping_up(stream, [o for pair in zip(a, b) for o in pair])
    assert "".join(o.text for o in got if o.index == 0) == "abcdefghi"
    assert "".join(o.text for o in got if o.index == 1) == "rstuvwxyz"
    # Each sequence's first output wakes at once, its last with its finish; between
    # them, every third token of either (a wake-up takes what both hold).
    for index in (0, 1):
        mine = [o for o in got if o.index == index]
        assert len(mine[0].new_token_ids) == 1 and mine[-1].finish_reason == "length"
        assert all(o.finish_reason is None for o in mine[:-1])
    assert len(got) <= 2 + 2 * 8 // 3 + 2
