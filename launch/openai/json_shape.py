"""What a request body's JSON may hold before it is decoded: at most MAX_JSON_DEPTH levels
of arrays and objects (the decoder recurses into them, and a deep enough body makes it
fail), and at most MAX_JSON_VALUES array items and object members (the decoder holds the
GIL for the whole body, so millions of small values would stall every connection)."""

from __future__ import annotations

import numpy as np

# Arrays and objects inside each other; OpenAI's bodies (JSON schemas included) nest far less.
MAX_JSON_DEPTH = 128
# Items and members in all: far above any prompt a context holds (token ids are one each),
# and about as many as the decoder builds in tens of milliseconds.
MAX_JSON_VALUES = 1 << 20

# Bodies are scanned a slice at a time so that a huge one needs little scratch memory.
_SLICE = 1 << 20
# Each byte's step in depth: +1 opens an array or object, -1 closes one.
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_QUOTE, _COMMA = ord('"'), ord(",")


def json_shape_error(
    raw: bytes, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES
) -> str | None:
    """Why raw (JSON) may not be decoded, or None. Linear, in a few passes of bytes and
    numpy (no Python step per byte); brackets and commas inside strings are text."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= max_depth and raw.count(b",") + opens <= max_values:
        return None  # most bodies stop here
    if b"\\" in raw:
        # With escaped backslashes, then escaped quotes, gone, every quote left opens or
        # closes a string.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(raw, np.uint8)
    depth, values, in_string = 0, 0, np.uint8(0)
    for start in range(0, len(text), _SLICE):
        part = text[start : start + _SLICE]
        # Inside a string after an odd number of quotes.
        inside = np.bitwise_xor.accumulate((part == _QUOTE).view(np.uint8)) ^ in_string
        in_string = inside[-1]
        outside = ~inside.view(bool)
        # One comma between each two values of a container: values = commas + containers.
        values += int(np.count_nonzero((part == _COMMA) & outside))
        steps = _STEP[part]
        steps[~outside] = 0
        running = np.cumsum(steps, dtype=np.int32)
        if depth + int(running.max()) > max_depth:
            return f"the body nests arrays and objects more than {max_depth} levels deep"
        depth += int(running[-1])
        values += int(np.count_nonzero(steps == 1))
        if values > max_values:
            return f"the body holds more than {max_values} array items and object members"
    return None
