"""Tool calls in chat completions (OpenAI's `tools` and `tool_choice`).

The tools go to the chat template (as transformers passes them, so a model trained on
tool use sees its own format); what the answer may be depends on tool_choice:
- "none": text, as without tools.
- a named function: the output is that function's arguments, held to its `parameters`
  schema by structured outputs; answered as one tool call.
- "required": a JSON array of at least one {"name", "parameters"} object, each held to
  one tool's schema (one call only when parallel_tool_calls is false); answered as calls.
- "auto" (the default when tools are given): the model decides, in its own format, so
  the server must know that format: `--tool-call-parser` (launch/openai/tool_parsers.py: hermes,
  llama3_json, mistral, pythonic) reads the calls out of the text. Without a parser "auto"
  is refused (as vLLM does), naming the choices that work.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from launch.openai.tool_parsers import (
    KEEPS_SPECIAL_TOKENS,
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallParser,
    content_so_far,
    new_call_id,
    parse_calls,
)
from protocol.engine import StructuredOutputs


class ToolError(ValueError):
    """A tools or tool_choice the request cannot have (the server answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None  # accepted: the schema is enforced either way


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of its answer."""

    choice: Literal["none", "auto", "named", "required"]
    tools: list[ToolDef]
    name: str | None = None  # the named function
    # The model's format: "auto" answers are read in it, and call ids follow it.
    parser: ToolCallParser | None = None
    parallel: bool = True

    @property
    def constraint(self) -> StructuredOutputs | None:
        """The language the output is held to (named and required), else None."""
        if self.choice == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputs(json=_schema_text(fn))
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "parameters": json.loads(_schema_text(t.function)),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputs(json=json.dumps(array))
        return None

    @property
    def streams_text(self) -> bool:
        """Whether text deltas can go out as they come (not for calls parsed at the end)."""
        return self.choice in ("none", "auto")

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them (transformers' `tools`)."""
        return [msgspec.to_builtins(t) for t in self.tools]

    def calls(self, text: str, complete: bool) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer's text; complete: it ended by its
        own EOS, not cut at max_tokens (a cut one keeps what it has as content, or, for a
        named function, as that call's arguments)."""
        if self.choice == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, text, new_call_id(self.parser))]
        if self.choice == "required":
            try:
                parsed = json.loads(text)
            except ValueError:
                return text, []  # cut before the array closed
            return None, [
                ToolCall(c["name"], json.dumps(c["parameters"]), new_call_id(self.parser))
                for c in parsed
            ]
        if self.choice == "auto" and self.parser is not None:
            content, calls = parse_calls(self.parser, text)
            # Without parallel calls an answer holds one at most, as OpenAI's do: the
            # model's later ones are dropped.
            return content, calls if self.parallel else calls[:1]
        return text, []

    def content_so_far(self, text: str) -> int:
        """How much of a streaming "auto" answer is content for sure (the rest may be
        the start of a call in the model's format, held until it is told apart)."""
        assert self.choice == "auto" and self.parser is not None
        return content_so_far(self.parser, text)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text must keep special tokens: the format's markers are
        ones (Mistral's [TOOL_CALLS])."""
        return self.choice == "auto" and self.parser in KEEPS_SPECIAL_TOKENS


def _schema_text(fn: FunctionDef) -> str:
    return json.dumps(fn.parameters if fn.parameters is not None else {"type": "object"})


def plan_tools(
    tools: list[ToolDef] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    parser: ToolCallParser | None,
) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); ToolError for a combination that
    cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct function names", "tools")
    for t in tools:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", t.function.name):
            raise ToolError(
                f"function name {t.function.name!r}: 1-64 letters, digits, _ or -", "tools"
            )
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        return ToolPlan("named", tools, name=name, parser=parser, parallel=parallel_tool_calls)
    choice = tool_choice or "auto"
    if choice == "auto" and parser is None:
        raise ToolError(
            'tool_choice "auto" needs the model\'s tool-call format: start the server with '
            f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), or send tool_choice "
            '"required", a named function or "none"',
            "tool_choice",
        )
    return ToolPlan(choice, tools, parser=parser, parallel=parallel_tool_calls)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """messages for the chat template: an assistant turn's tool-call arguments, JSON text
    on the wire, become objects, which templates expect (transformers' convention)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_parsed_arguments(c) for c in calls]}
        out.append(m)
    return out


def _parsed_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": arguments}}
    return call
