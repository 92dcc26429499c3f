"""Request fields this server does not know: ignored with a warning (as vLLM does, so a
client library that fills a newer OpenAI field still works), or, with
--strict-request-fields, refused as a 400 naming the field.

Bodies are msgspec Structs that refuse unknown fields, so the common body decodes in one
pass; only a body carrying unknown fields is decoded again, each unknown field dropped
where msgspec found it (nested objects too)."""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec

log = logging.getLogger("pagedserve.openai")

T = TypeVar("T")

# Bounds the re-decoding a body with many unknown fields costs (one pass per field).
MAX_IGNORED_FIELDS = 32

_UNKNOWN = re.compile(r"^Object contains unknown field `(.+?)`(?: - at `\$(.*)`)?$")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def decode_lenient(raw: bytes, kind: type[T], strict: bool) -> tuple[T, list[str]]:
    """raw decoded as kind, and the unknown fields dropped on the way (their JSON paths);
    strict: none dropped, msgspec's error raised. Errors other than unknown fields are
    msgspec's, as a strict decode raises them."""
    try:
        return msgspec.json.decode(raw, type=kind), []
    except msgspec.ValidationError as e:
        if strict or _UNKNOWN.match(str(e)) is None:
            raise
        error = e
    doc = msgspec.json.decode(raw)
    dropped: list[str] = []
    for _ in range(MAX_IGNORED_FIELDS):
        where = _unknown_field(doc, str(error))
        if where is None:
            break
        dropped.append(where)
        try:
            return msgspec.json.decode(msgspec.json.encode(doc), type=kind), dropped
        except msgspec.ValidationError as e:
            error = e
    raise error


def _unknown_field(doc: Any, message: str) -> str | None:
    """Drops the unknown field message names from doc; its path, or None when message is
    about something else (or the path cannot be followed)."""
    found = _UNKNOWN.match(message)
    if found is None:
        return None
    name, path = found.group(1), found.group(2) or ""
    node = doc
    for key, index in _STEP.findall(path):
        try:
            node = node[key] if key else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    if not isinstance(node, dict) or name not in node:
        return None
    del node[name]
    return f"{path[1:]}.{name}" if path else name


def debug_enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


def log_ignored(route: str, unknown: list[str], unused: list[str]) -> None:
    """One line per request for each kind of field it sent that has no effect here."""
    if unknown:
        log.warning("%s: ignored unknown request fields: %s", route, ", ".join(unknown))
    if unused:
        log.debug("%s: accepted, with no effect here: %s", route, ", ".join(unused))
