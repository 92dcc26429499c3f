"""The answers' JSON shapes (response_shapes.py): server-sent events."""

from __future__ import annotations

import json

from launch.openai.response_shapes import sse_event


def test_an_event_breaks_no_line_inside_its_json() -> None:
    """Text with the characters str.splitlines ends lines at (U+0085, U+2028, U+2029):
    a client reading lines that way (httpx's iter_lines) still gets one whole event."""
    text = 'a\u2028b\x85c\u2029d\u00e9\n"}'
    event = sse_event({"text": text}).decode()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert event[:-2].splitlines() == [event[:-2]]
    assert json.loads(event[len("data: ") : -2]) == {"text": text}
