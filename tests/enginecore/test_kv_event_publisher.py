"""enginecore/kv_event_publisher.py: which endpoints bind, one sequence number per
non-empty step, and a replay of every buffered batch from the sequence number asked,
closed by the end marker; malformed replay requests are ignored."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from enginecore.kv_event_publisher import KVEventPublisher, should_bind
from protocol.kv_events import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, KVEventBatch


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:0", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.example:5557", False),
    ],
)
def test_wildcards_local_transports_and_port_0_bind_the_rest_connect(
    endpoint: str, binds: bool
) -> None:
    assert should_bind(endpoint) is binds


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _replay(publisher: KVEventPublisher, dealer: zmq.Socket, frames: list[bytes]) -> list:
    """Send one replay request; the (topic, seq, batch) answers until the end marker."""
    dealer.send_multipart(frames)
    got = []
    while True:
        for _ in range(500):  # a bound, so a lost answer fails instead of hanging
            publisher.serve_replays()
            if dealer.poll(10):
                break
        else:
            pytest.fail("no answer to the replay request")
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_OF_REPLAY:
            return got
        got.append(
            (topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch))
        )


def test_a_replay_sends_every_kept_batch_from_the_number_asked(ctx: zmq.Context) -> None:
    publisher = KVEventPublisher(ctx, "inproc://pub", "inproc://replay", buffer_steps=3, topic="t")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("inproc://replay")
    try:
        publisher.publish([])  # nothing happened: no batch, no number
        assert publisher.next_seq == 0
        for i in range(5):
            publisher.publish([BlockRemoved([bytes([i])], "GPU", 0)])
        assert publisher.next_seq == 5
        # Only the last three (2, 3, 4) are kept; asking from 3 gets 3 and 4.
        got = _replay(publisher, dealer, [b"", (3).to_bytes(8, "big")])
        assert [(topic, seq) for topic, seq, _ in got] == [(b"t", 3), (b"t", 4)]
        assert got[0][2].events == [BlockRemoved([b"\x03"], "GPU", 0)]
        got = _replay(publisher, dealer, [b"", (0).to_bytes(8, "big")])
        assert [seq for _, seq, _ in got] == [2, 3, 4]
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_malformed_replay_request_is_ignored_and_the_next_answered(ctx: zmq.Context) -> None:
    publisher = KVEventPublisher(ctx, "inproc://pub2", "inproc://replay2", data_parallel_rank=1)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("inproc://replay2")
    try:
        publisher.publish([AllBlocksCleared()])
        dealer.send_multipart([b"", b"short"])
        got = _replay(publisher, dealer, [b"", (0).to_bytes(8, "big")])
        assert [seq for _, seq, _ in got] == [0]
        assert got[0][2].data_parallel_rank == 1
    finally:
        dealer.close(linger=0)
        publisher.close()


def test_a_buffer_of_no_steps_is_refused(ctx: zmq.Context) -> None:
    with pytest.raises(ValueError, match="buffer_steps must be >= 1, got 0"):
        KVEventPublisher(ctx, "inproc://pub3", buffer_steps=0)
