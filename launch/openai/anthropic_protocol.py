"""Anthropic's Messages API bodies (POST /v1/messages, POST /v1/messages/count_tokens),
decoded and checked once, and turned into the chat completion they stand for.

A Messages conversation becomes chat messages: `system` the system message (its text
blocks joined by newlines), a user turn's text blocks one user message, its tool_result
blocks tool messages (before its text, as they answer the previous turn's calls), an
assistant turn's text its content and its tool_use blocks its tool_calls (input as JSON
arguments). A conversation that ends with an assistant turn is continued, as Anthropic
does with a prefilled answer. tools become function tools (input_schema their
parameters), tool_choice auto / any / tool / none chat's auto / required / named / none.

Unknown fields are ignored with a warning in the log, as vLLM does; image and document
blocks and server tools are refused by name (a text-only engine). metadata,
service_tier and cache_control are accepted and unused; output_config.format (a JSON
schema) holds the answer to it; thinking is accepted (with a reasoning parser the answer's
reasoning comes back as thinking blocks, unless thinking is disabled).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import msgspec

from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    JSONSchemaFormat,
    ResponseFormat,
    decode_body,
)
from launch.openai.tools import FunctionDef, FunctionName, NamedToolChoice, ToolDef

log = logging.getLogger("pagedserve.serve")

# Anthropic's error types by HTTP status (its clients raise a typed error per status).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "overloaded_error",
    503: "overloaded_error",
}


def error_body(e: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class CacheControl(msgspec.Struct):
    """Accepted (on the request, blocks and tools) and unused: the prefix cache needs no
    hint."""

    type: str
    ttl: str | None = None


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # accepted, unused


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    """Decoded only to be refused by name."""


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    """Decoded only to be refused by name."""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    """An earlier answer's thinking: left out of the history, as chat templates do."""

    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class MessageParam(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    """A client tool; server tools (a `type` other than custom) are refused by name."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted: the answer's length bounds the thinking


class Metadata(msgspec.Struct):
    user_id: str | None = None


class JSONOutputFormat(msgspec.Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct):
    """format: the answer held to a JSON schema (structured outputs); effort accepted."""

    format: JSONOutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens: the prompt a Messages request would render."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (system first)."""
        out: list[dict[str, Any]] = []
        system = self.system
        if system:
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            out += _turn(m, f"messages[{i}]")
        if not self.messages:
            raise _bad("messages must hold at least one message", "messages")
        return out

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The same request in chat completions' terms (what renders, samples and checks
        it); sampling: the chat body's sampling fields."""
        for t in self.tools or ():
            if t.type not in (None, "custom"):
                raise _bad(
                    f"tool {t.name!r} is a server tool ({t.type}): this server runs only "
                    "client tools (name, description, input_schema)",
                    "tools",
                )
        choice = self.tool_choice
        tool_choice: Any = None
        if choice is not None:
            if choice.type == "tool":
                if choice.name is None:
                    raise _bad('tool_choice of type "tool" needs a name', "tool_choice")
                tool_choice = NamedToolChoice("function", FunctionName(choice.name))
            else:
                tool_choice = {"any": "required"}.get(choice.type, choice.type)
        tools = [
            ToolDef("function", FunctionDef(t.name, t.description, t.input_schema))
            for t in self.tools or ()
        ]
        continues = self.messages[-1].role == "assistant" if self.messages else False
        return ChatCompletionRequest(
            messages=self.chat_messages(),
            tools=tools or None,
            tool_choice=tool_choice,
            parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
            add_generation_prompt=not continues,
            continue_final_message=continues,
            **sampling,
        )


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, one tier here
    cache_control: CacheControl | None = None  # accepted: the prefix cache needs no hint
    output_config: OutputConfig | None = None

    def check(self) -> None:
        """What the types cannot say, as Anthropic's 400s say it."""
        if self.max_tokens < 1:
            raise _bad(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        t = self.temperature
        if t is not None and not 0.0 <= t <= 1.0:
            raise _bad(f"temperature must be in [0, 1], got {t}", "temperature")

    def chat(self) -> ChatCompletionRequest:
        sampling: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                sampling[name] = value
        if self.stop_sequences:
            sampling["stop"] = self.stop_sequences
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            schema = JSONSchemaFormat("output", fmt.schema)
            sampling["response_format"] = ResponseFormat("json_schema", schema)
        return self.chat_request(**sampling)


def decode(raw: bytes, kind: type[CountTokensRequest]) -> Any:
    """The body, or an APIError (400) naming the field that is wrong. Fields this server
    does not know are ignored with a warning, as vLLM does: agents built on Anthropic's
    clients send newer ones (context management, containers) that mean nothing here."""
    body = decode_body(raw, kind)  # type: ignore[arg-type]
    unknown = set(msgspec.json.decode(raw, type=dict[str, msgspec.Raw])) - _FIELDS[kind]
    if unknown:
        log.warning("%s: ignored unknown fields %s", _ROUTES[kind], ", ".join(sorted(unknown)))
    return body


_FIELDS = {k: set(k.__struct_fields__) for k in (CountTokensRequest, MessagesRequest)}
_ROUTES = {CountTokensRequest: "/v1/messages/count_tokens", MessagesRequest: "/v1/messages"}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, param=param, code="invalid_value")


def _turn(m: MessageParam, where: str) -> list[dict[str, Any]]:
    """One Messages turn as chat messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported_block(block, at)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise _bad(f"{at}: tool_use blocks belong to assistant turns", "messages")
            arguments = json.dumps(block.input)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise _bad(f"{at}: tool_result blocks belong to user turns", "messages")
            content = _result_text(block.content, at)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        # thinking blocks: an earlier answer's, left out
    out = results
    text = "\n".join(texts)
    if calls:
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": m.role, "content": text})
    return out


def _result_text(content: str | list[Any] | None, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for k, part in enumerate(content):
        if not isinstance(part, TextBlock):
            raise _unsupported_block(part, f"{at}.content[{k}]")
    return "\n".join(part.text for part in content)


def _unsupported_block(block: msgspec.Struct, at: str) -> APIError:
    kind = "image" if isinstance(block, ImageBlock) else "document"
    return APIError(
        f"{at}: {kind} blocks are not supported: this server serves a text-only model",
        param="messages",
        code="unsupported_content",
    )
