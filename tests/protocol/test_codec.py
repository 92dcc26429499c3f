"""protocol/codec.py: a channel's messages round-trip, and a frame that is not one of
them raises ProtocolError naming the channel, the size and the first bytes."""

from __future__ import annotations

import msgspec
import pytest

from protocol.codec import Codec, ProtocolError
from protocol.engine import AbortRequests, AddRequest, ClientMessage, SamplingParams


def test_every_message_of_the_union_round_trips() -> None:
    codec: Codec[ClientMessage] = Codec(ClientMessage, "client->core")
    messages = [
        AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, stop=["x"]), priority=2),
        AbortRequests(["a", "b"]),
    ]
    for message in messages:
        assert codec.decode(codec.encode(message)) == message
        assert codec.decode(memoryview(codec.encode(message))) == message


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1garbage",  # not msgpack
        msgspec.msgpack.encode({"type": "nope"}),  # a tag the union lacks
        msgspec.msgpack.encode({"type": "abort", "request_ids": "r"}),  # a wrong field type
    ],
)
def test_a_bad_frame_names_the_channel_its_size_and_first_bytes(frame: bytes) -> None:
    codec: Codec[ClientMessage] = Codec(ClientMessage, "client->core")
    with pytest.raises(ProtocolError) as caught:
        codec.decode(frame)
    message = str(caught.value)
    assert message.startswith(
        f"malformed frame on the client->core channel ({len(frame)} bytes, "
        f"starts {frame[:32].hex()}): "
    )
    assert isinstance(caught.value, ValueError)
