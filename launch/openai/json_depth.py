"""How deep a request body's JSON may nest: MAX_JSON_DEPTH levels of arrays and objects,
checked before the decoder recurses into it (which a deep enough body makes fail)."""

from __future__ import annotations

import numpy as np

# Arrays and objects inside each other; OpenAI's bodies (JSON schemas included) nest far less.
MAX_JSON_DEPTH = 128

# Depth is summed a slice at a time so that a huge body needs little scratch memory.
_SLICE = 1 << 20
# Each byte's step in depth: +1 opens an array or object, -1 closes one.
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether raw (JSON) nests arrays and objects more than limit deep. Linear, in a few
    passes of bytes and numpy (no Python step per byte), brackets inside strings ignored."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # too few brackets to nest that deep: most bodies stop here
    if b"\\" in raw:
        # With escaped backslashes, then escaped quotes, gone, every quote left opens or
        # closes a string.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(raw, np.uint8)
    depth, in_string = 0, np.uint8(0)
    for start in range(0, len(text), _SLICE):
        part = text[start : start + _SLICE]
        steps = _STEP[part]
        # Inside a string after an odd number of quotes: its brackets are text.
        inside = np.bitwise_xor.accumulate((part == ord('"')).view(np.uint8)) ^ in_string
        in_string = inside[-1]
        steps[inside.view(bool)] = 0
        running = np.cumsum(steps, dtype=np.int32)
        if depth + int(running.max()) > limit:
            return True
        depth += int(running[-1])
    return False
