"""Tool calls in a model's own format, read out of its text (`--tool-call-parser`).

Each format says two things: which calls a finished answer holds, and the content (the
text around them); and, while the answer streams, how much of it is content for sure (the
rest may still turn out to be a call, so a stream holds it back). A block that does not
parse stays in the content: a model that writes half a call says so in its answer.

- hermes (Hermes, Qwen 2.5 / Qwen3 and others): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks anywhere in the text.
- llama3_json (Llama 3.1-3.3's JSON tool calling): the whole answer is one JSON object
  `{"name": ..., "parameters": {...}}` (or "arguments"), or several separated by `;`,
  after an optional `<|python_tag|>`.
- mistral: `[TOOL_CALLS]` and then a JSON array of `{"name", "arguments"}` objects (v3
  tokenizers), or `name[ARGS]{...}` per call (v11+); the text before it is content. The
  marker is a special token, so such a request keeps special tokens in its text. Call ids
  are 9 letters and digits, as Mistral's chat templates require when calls come back.
- pythonic (Llama 3.2 / Llama 4 and others): the whole answer is a Python list of calls
  with keyword arguments of literal values, `[get_weather(city="Oslo"), now()]`, after an
  optional `<|python_start|>`.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from launch.client.stop_strings import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
ToolCallParser = Literal["hermes", "llama3_json", "mistral", "pythonic"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


_ALNUM = string.ascii_letters + string.digits


def new_call_id(parser: ToolCallParser | None = None) -> str:
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# Parsed: the content (None when calls took all of it) and (name, arguments object) pairs.
Parsed = tuple[str | None, list[tuple[str, Any]]]


# -- hermes ----------------------------------------------------------------------------
_HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> Parsed:
    calls: list[tuple[str, Any]] = []
    kept: list[str] = []
    last = 0
    for block in _HERMES_BLOCK.finditer(text):
        call = _named_object(block.group(1), "arguments")
        if call is None:
            continue
        kept.append(text[last : block.start()])
        last = block.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ((content or None) if calls else text), calls


def _hermes_content(text: str) -> int:
    start = text.find(_HERMES_OPEN)
    if start >= 0:
        return start
    return len(text) - partial_suffix(text, (_HERMES_OPEN,))


# -- llama3_json -----------------------------------------------------------------------
_PYTHON_TAG = "<|python_tag|>"


def _llama3_json(text: str) -> Parsed:
    body = text.strip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    decoder = json.JSONDecoder()
    calls: list[tuple[str, Any]] = []
    at = 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _named_value(value, "parameters", "arguments")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(body) - len(rest)
    return (None, calls) if calls else (text, [])


def _whole_answer_content(text: str, openers: tuple[str, ...]) -> int:
    """For formats whose calls are the whole answer: all of it is content once it
    cannot begin with an opener; none of it while it may."""
    head = text.lstrip()
    if not head or any(head.startswith(o) or o.startswith(head) for o in openers):
        return 0
    return len(text)


def _llama3_json_content(text: str) -> int:
    return _whole_answer_content(text, ("{", _PYTHON_TAG))


# -- mistral ---------------------------------------------------------------------------
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def _mistral(text: str) -> Parsed:
    start = text.find(_MISTRAL_MARK)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    rest = text[start + len(_MISTRAL_MARK) :].strip()
    calls: list[tuple[str, Any]] = []
    if rest.startswith("["):  # v3: a JSON array of calls
        try:
            values = json.loads(rest)
        except ValueError:
            return text, []
        if not isinstance(values, list):
            return text, []
        for value in values:
            call = _named_value(value, "arguments", "parameters")
            if call is None:
                return text, []
            calls.append(call)
    else:  # v11+: name[ARGS]{...}, each call after its own marker
        for part in rest.split(_MISTRAL_MARK):
            name, sep, arguments = part.strip().partition(_MISTRAL_ARGS)
            try:
                value = json.loads(arguments) if sep else None
            except ValueError:
                return text, []
            if not (name and isinstance(value, dict)):
                return text, []
            calls.append((name, value))
    return (content, calls) if calls else (text, [])


def _mistral_content(text: str) -> int:
    start = text.find(_MISTRAL_MARK)
    if start >= 0:
        return start
    return len(text) - partial_suffix(text, (_MISTRAL_MARK,))


# -- pythonic --------------------------------------------------------------------------
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


def _pythonic(text: str) -> Parsed:
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls: list[tuple[str, Any]] = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return text, []
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return text, []
        if None in arguments:  # **kwargs
            return text, []
        calls.append((node.func.id, arguments))
    return None, calls


def _pythonic_content(text: str) -> int:
    return _whole_answer_content(text, ("[", _PYTHON_START))


# -- shared ----------------------------------------------------------------------------
def _named_object(text: str, *keys: str) -> tuple[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _named_value(value, *keys)


def _named_value(value: Any, *keys: str) -> tuple[str, Any] | None:
    """(name, arguments) of {"name": str, key: object} for the first key present
    (arguments default to {}); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


_FORMATS: dict[str, tuple[Callable[[str], Parsed], Callable[[str], int]]] = {
    "hermes": (_hermes, _hermes_content),
    "llama3_json": (_llama3_json, _llama3_json_content),
    "mistral": (_mistral, _mistral_content),
    "pythonic": (_pythonic, _pythonic_content),
}
# Formats whose markers are special tokens, lost when a request skips special tokens.
KEEPS_SPECIAL_TOKENS = frozenset(("mistral",))


def parse_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished answer's (content, calls) in the parser's format."""
    content, found = _FORMATS[parser][0](text)
    calls = [ToolCall(name, json.dumps(args), new_call_id(parser)) for name, args in found]
    return content, calls


def content_so_far(parser: ToolCallParser, text: str) -> int:
    """How many leading characters of a streaming answer are content for sure."""
    return _FORMATS[parser][1](text)
