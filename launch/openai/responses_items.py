"""A Responses body's input items as the chat messages the template renders (and back,
as OpenAI lists a stored response's input items)."""

from __future__ import annotations

import uuid
from typing import Any

from launch.openai.protocol import APIError

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """The input as chat messages: a text is one user message; items are messages
    (developer becomes system, which chat templates know), function calls (an assistant
    turn's tool_calls, consecutive ones in one turn) and their outputs (tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad_input(f"{where} must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise _bad_input(
                    f"{where}.role must be user, assistant, system or developer, "
                    f"got {item.get('role')!r}"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise _bad_input(f"{where}: a function_call needs call_id, name and arguments")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking: templates leave it out of the history
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad_input(f"{where}: a function_call_output needs its call_id")
            content = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise _bad_input(
                f"{where}: items of type {kind!r} are not supported here (message, "
                "function_call, function_call_output, reasoning)"
            )
    return out


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_input(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _bad_input(
                f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS[:2])}) are "
                f"supported, got {kind!r}"
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _bad_input(f"{where}[{j}] has no text")
        texts.append(text)
    return "".join(texts)


def _bad_input(message: str) -> APIError:
    return APIError(message, param="input", code="invalid_value")


def leading_system(messages: list[dict[str, Any]]) -> int:
    """How many system messages open the conversation (truncation keeps them)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    return head


def turn_starts(messages: list[dict[str, Any]]) -> list[int]:
    """truncation "auto": where the rest of the conversation starts once its k oldest turns
    after the leading system messages are dropped (k = 0, 1, ...), each turn with the tool
    results that answered it; the last entry leaves one turn. One pass."""
    at = leading_system(messages)
    starts = [at]
    while True:
        at += 1
        while at < len(messages) and messages[at]["role"] == "tool":  # their call went too
            at += 1
        if at >= len(messages):
            return starts
        starts.append(at)


def without_oldest_turns(messages: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The conversation's leading system messages, then its messages from start on (a
    turn_starts entry)."""
    return messages[: leading_system(messages)] + messages[start:]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_item_list(value: str | list[Any]) -> list[dict[str, Any]]:
    """The input as OpenAI lists it back: items with ids, a text as a user message,
    message content as parts. (Checked already by input_messages.)"""
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(kind, "item")
        item.setdefault("id", new_item_id(prefix))
        out.append(item)
    return out
