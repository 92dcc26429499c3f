"""One reusable msgpack encoder/decoder per socket direction, with clear frame errors."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame that is not a valid message of the channel."""


class Codec(Generic[T]):
    """Encodes anything of the channel's union and decodes frames back into it."""

    def __init__(self, message_type: Any, channel: str) -> None:
        self.channel = channel
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            head = bytes(frame[:32]).hex()
            raise ProtocolError(
                f"malformed frame on the {self.channel} channel ({len(frame)} bytes, "
                f"starts {head}): {e}"
            ) from None
