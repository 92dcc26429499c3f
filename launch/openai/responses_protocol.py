"""OpenAI's Responses API (POST /v1/responses) over the chat-completions machinery.

A Responses body is a conversation in items (messages, function calls and their outputs)
plus instructions; it is rendered by the chat template exactly as the same conversation in
chat completions would be, sampled with the same SamplingParams, and answered as a
Response: output items (an assistant message of output_text, function calls), a status
("incomplete" when max_output_tokens cut it), usage in input/output tokens. Streamed, it is
OpenAI's typed events (`event: <type>` and `data: <JSON>`, numbered by sequence_number, no
[DONE]): response.created, output items and content parts opened, text and function
arguments deltas, each closed, then response.completed / response.incomplete /
response.failed.

State: a response asked to be stored (`store`, true by default as at OpenAI) is kept in a
bounded in-memory ResponseStore, oldest dropped first, so `previous_response_id` continues
its conversation (its input and output; instructions are not carried over, as at OpenAI)
and GET/DELETE /v1/responses/{id} find it. A `background` response is answered at once
(status "queued") and generated meanwhile; GET shows its progress and POST
/v1/responses/{id}/cancel stops it. `truncation: "auto"` drops the oldest turns of a
conversation that does not fit the context. The answer itself: responses_output.py; the
store: responses_store.py; input items as chat messages: responses_items.py.

Only what this engine can serve is accepted: function tools (hosted tools, images, files,
reasoning are refused by name).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    JSONSchemaFormat,
    ResponseFormat,
    StructuredOutputsBody,
    sampling_fields,
)
from launch.openai.tools import FunctionDef, FunctionName, NamedToolChoice, ToolDef

# OpenAI's limits on metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    """text.format: text, json_object, or json_schema (name, schema) flattened."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A Responses function tool: chat completions' function, flattened."""

    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool = False  # accepted: no obfuscation padding is added


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class _ResponsesOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of a Responses body that are not sampling parameters; those are
    SamplingParams' own declarations (ResponsesRequest, below), which these methods read."""

    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None  # accepted, echoed
    safety_identifier: str | None = None  # accepted, echoed
    prompt_cache_key: str | None = None  # accepted, echoed (prefix caching needs no key)
    service_tier: Literal["auto", "default"] | None = None
    reasoning: Reasoning | None = None
    background: bool = False
    max_tool_calls: int | None = None
    # vLLM's extensions.
    cache_salt: str | None = None
    priority: int = 0
    structured_outputs: StructuredOutputsBody | None = None

    def unsupported(self) -> list[str]:
        """The options set to something this engine cannot do."""
        bad = []
        r = self.reasoning
        if r is not None and (r.effort not in (None, "none") or r.summary or r.generate_summary):
            bad.append("reasoning")  # no model served here reasons apart from its answer
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            bad.append("text.verbosity")
        if any(item != LOGPROBS_INCLUDE for item in self.include or ()):
            bad.append("include")
        return bad

    def check(self) -> None:
        """What the types cannot say, as OpenAI's 400s say it."""
        bad = self.unsupported()
        if bad:
            raise APIError(
                f"{', '.join(bad)}: not supported by this server"
                + (f" (include takes only {LOGPROBS_INCLUDE!r})" if "include" in bad else ""),
                param=bad[0],
                code="unsupported_parameter",
            )
        if self.background and (self.stream or not self.store):
            # Its answer is fetched later (GET, or cancelled): it must be kept, not streamed.
            raise APIError(
                "background needs store true and stream false",
                param="background",
                code="invalid_value",
            )
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(
                f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                param="max_output_tokens",
                code="invalid_value",
            )
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()
        ):
            raise APIError(
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
                param="metadata",
                code="invalid_value",
            )

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The same request in chat completions' terms (what samples and checks it)."""
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None and fmt.type != "text":
            schema = None
            if fmt.type == "json_schema":
                if fmt.name is None or fmt.schema is None:
                    raise APIError(
                        "text.format of type json_schema needs a name and a schema",
                        param="text.format",
                        code="missing_required_parameter",
                    )
                schema = JSONSchemaFormat(fmt.name, fmt.schema, fmt.description, fmt.strict)
            response_format = ResponseFormat(fmt.type, schema)
        choice = self.tool_choice
        return ChatCompletionRequest(
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
            priority=self.priority,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs if self.wants_logprobs else None,
            response_format=response_format,
            structured_outputs=self.structured_outputs,
            tools=[
                ToolDef("function", FunctionDef(t.name, t.description, t.parameters, t.strict))
                for t in self.tools
            ]
            if self.tools
            else None,
            tool_choice=NamedToolChoice("function", FunctionName(choice.name))
            if isinstance(choice, FunctionChoice)
            else choice,
            parallel_tool_calls=self.parallel_tool_calls,
            stream=self.stream,
        )


# OpenAI's temperature and top_p, and vLLM's sampling extensions, as SamplingParams
# declares them.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
)
ResponsesRequest = msgspec.defstruct(
    "ResponsesRequest",
    sampling_fields(_SAMPLING_FIELDS),
    bases=(_ResponsesOptions,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)
ResponsesRequest.__doc__ = (
    "POST /v1/responses: OpenAI's fields this engine serves, and vLLM's sampling "
    "extensions (top_k, min_p, seed, stop, penalties, ignore_eos, cache_salt, priority, "
    "structured_outputs)."
)
