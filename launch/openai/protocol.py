"""The OpenAI-compatible request bodies: decoded and checked once, at the boundary.

A completions `prompt` is a text, a list of token ids, or a list of up to
MAX_PROMPTS_PER_REQUEST of either (each its own engine request, answered as choices
prompt-major); every prompt is checked before any is sent.

Bodies are msgspec Structs. A field no body declares is ignored with a warning, as vLLM
does, or refused as a 400 naming it under --strict-request-fields
(launch/openai/request_fields.py). OpenAI's standard fields that mean nothing here
(metadata, store, service_tier, ...) and vLLM's extensions this engine has no use for are
declared, so they are accepted, also as null, and logged at debug level when set. Options
whose silent loss would change an answer (suffix, structural_tag) are refused unless null.
Sampling options are checked by SamplingParams.validate: n in [1, 16], at most 4
non-empty stop strings, presence and frequency penalties in [-2, 2], repetition_penalty
> 0, min_tokens in [0, max_tokens], logprobs / top_logprobs in [0, 20], seed in [0,
2**63). Extensions beyond OpenAI's API (vLLM's): top_k, min_tokens, repetition_penalty,
stop_token_ids, ignore_eos, cache_salt, priority (lower first, with --scheduling-policy
priority; else only 0), return_token_ids (the token ids of prompt and completion in the
response), prompt_logprobs (each prompt token's logprob and that many alternatives,
vLLM's shape), structured_outputs (json, regex, choice, grammar; OpenAI's
response_format is the same thing for JSON), and for chat add_generation_prompt and
chat_template_kwargs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec

from launch.openai.json_shape import json_shape_error
from launch.openai.request_fields import debug_enabled, decode_lenient, log_ignored
from launch.openai.tools import FunctionDef, FunctionName, NamedToolChoice, ToolChoice, ToolDef
from protocol.engine import GREEDY_TEMPERATURE, SamplingParams, StructuredOutputs

# vLLM's request_id: the answer's id ends with it, so it is kept short and printable.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# Prompts in one completions request (a list of texts or token-id lists): each is its own
# engine request (n of them with n > 1), all checked before any is sent. Bounded so one
# body cannot queue an unbounded batch behind a single admission check.
MAX_PROMPTS_PER_REQUEST = 128


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's, with code invalid_api_key
    404: "not_found_error",
    503: "service_unavailable",
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk


class JSONSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's response_format: text, json_object or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's structured_outputs: json (a schema, as an object or its JSON text),
    json_object, regex, choice or grammar (Lark or GBNF)."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def to_wire(self) -> StructuredOutputs:
        schema = self.json
        return StructuredOutputs(
            json=schema if schema is None or isinstance(schema, str) else _json_text(schema),
            json_object=self.json_object,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            disable_any_whitespace=self.disable_any_whitespace,
        )


def _json_text(value: Any) -> str:
    return msgspec.json.encode(value).decode()


class _GenerationOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields of a generation body that are not sampling parameters; those are
    SamplingParams' own declarations (GenerationRequest, below), which these methods read."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # vLLM's extension: lower runs first under --scheduling-policy priority.
    priority: int = 0
    return_token_ids: bool = False
    user: str | None = None  # accepted, unused
    # The output kept inside a language: OpenAI's response_format, or vLLM's
    # structured_outputs.
    response_format: ResponseFormat | None = None
    # vLLM's: beam search instead of sampling, n beams wide (launch/client/beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: streamed chunks carry at least this many tokens (the server's, if larger).
    stream_interval: int | None = None
    # vLLM's: the answer's id ends with it (else a random one).
    request_id: str | None = None
    # vLLM's: tokens in logprobs as "token_id:N" rather than their text.
    return_tokens_as_token_ids: bool = False
    # OpenAI's, accepted with no effect here (see unused()).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's, accepted with no effect here: detokenizing follows the tokenizer's own
    # rules, prompts get the tokenizer's special tokens, and this engine has no KV
    # transfer or extra-argument plugins.
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's structural tags: not implemented; refused unless null (unsupported()).
    structural_tag: str | dict[str, Any] | None = None

    # Fields accepted without effect, each with the value that asks for nothing.
    _UNUSED: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("metadata", None),
        ("store", False),
        ("service_tier", "auto"),
        ("prompt_cache_key", None),
        ("prompt_cache_retention", None),
        ("safety_identifier", None),
        ("user", None),
        ("spaces_between_special_tokens", True),
        ("add_special_tokens", None),
        ("vllm_xargs", None),
        ("kv_transfer_params", None),
    )

    def unsupported(self) -> list[str]:
        """The options set to something this engine cannot do yet."""
        return [] if self.structural_tag is None else ["structural_tag"]

    def unused(self) -> list[str]:
        """The fields set that have no effect here (logged at debug level)."""
        return [
            name
            for name, neutral in self._UNUSED
            if (value := getattr(self, name)) is not None and value != neutral
        ]

    def check(self) -> None:
        """The rules between fields (vLLM's and OpenAI's), before any prompt is read."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options can only be given with stream: true",
                param="stream_options",
                code="invalid_value",
            )
        t = self.temperature
        if t is not None and not 0.0 <= t <= 2.0:  # NaN too
            raise APIError(
                f"temperature must be in [0, 2], got {t}", param="temperature", code="invalid_value"
            )
        if t is not None and t < GREEDY_TEMPERATURE and self.n > 1 and not self.use_beam_search:
            raise APIError(
                f"n must be 1 with greedy sampling (temperature {t}): every choice would be "
                "the same; raise the temperature for different ones",
                param="n",
                code="invalid_value",
            )
        rid = self.request_id
        if rid is not None and _REQUEST_ID.fullmatch(rid) is None:
            raise APIError(
                "request_id must be 1 to 128 letters, digits or ._:-",
                param="request_id",
                code="invalid_value",
            )

    def structured(self) -> tuple[StructuredOutputs | None, str]:
        """The wire's StructuredOutputs for response_format or structured_outputs (at most
        one of them), and the field's name for errors."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text":
            if so is not None:
                raise APIError(
                    "give response_format or structured_outputs, not both",
                    param="structured_outputs",
                    code="invalid_value",
                )
            if fmt.type == "json_object":
                return StructuredOutputs(json_object=True), "response_format"
            if fmt.json_schema is None:
                raise APIError(
                    "response_format of type json_schema needs a json_schema",
                    param="response_format",
                    code="missing_required_parameter",
                )
            schema = fmt.json_schema.schema
            if schema is None:
                return StructuredOutputs(json_object=True), "response_format"
            return StructuredOutputs(json=_json_text(schema)), "response_format"
        if so is None:
            return None, "structured_outputs"
        return so.to_wire(), "structured_outputs"

    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with; None: none."""
        return self.prompt_logprobs

    def stop_strings(self) -> list[str]:
        """null and [] mean none; a lone "" too (OpenAI's clients send it for none)."""
        if self.stop is None or self.stop == "":
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def num_logprobs(self) -> int | None:
        """How many top logprobs each token comes with; None: no logprobs at all."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# SamplingParams fields a body takes, declared there (type and default) once. OpenAI's
# logit_bias maps token ids (JSON keys, strings of digits) to values in [-100, 100];
# prompt_logprobs (vLLM's) asks for the prompt's tokens' logprobs. logprobs is each
# endpoint's own (a count, or chat's bool with top_logprobs).
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
    "ignore_eos",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "prompt_logprobs",
    "structured_outputs",
)
# Where HTTP differs: null means the default (max_tokens: the endpoint's), stop may be one
# string, structured_outputs takes a schema as an object too.
_HTTP_FIELDS: dict[str, tuple[Any, Any]] = {
    "max_tokens": (int | None, None),
    "stop_token_ids": (list[int] | None, None),
    "bad_words": (list[str] | None, None),
    "stop": (str | list[str] | None, None),
    "structured_outputs": (StructuredOutputsBody | None, None),
}


def sampling_fields(names: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """These SamplingParams fields as a body declares them (msgspec.defstruct's fields)."""
    declared = {f.name: f for f in msgspec.structs.fields(SamplingParams)}
    out = []
    for name in names:
        if name in _HTTP_FIELDS:
            out.append((name, *_HTTP_FIELDS[name]))
            continue
        f = declared[name]
        if f.default_factory is not msgspec.NODEFAULT:
            out.append((name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            out.append((name, f.type, f.default))
    return out


GenerationRequest = msgspec.defstruct(
    "GenerationRequest",
    sampling_fields(SAMPLING_FIELDS),
    bases=(_GenerationOptions,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
)
GenerationRequest.__doc__ = "Fields completions and chat completions share."


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        return bad

    def unused(self) -> list[str]:
        # best_of is accepted as vLLM accepts it: n choices are sampled, not best_of.
        extra = ["best_of"] if self.best_of not in (None, 1) else []
        return super().unused() + extra

    def check(self) -> None:
        super().check()
        if self.best_of is not None and not self.n <= self.best_of:
            raise APIError(
                f"best_of must be at least n ({self.n}), got {self.best_of}",
                param="best_of",
                code="invalid_value",
            )

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt's tokens come with logprobs (OpenAI's echo + logprobs)."""
        return self.echo and self.logprobs is not None

    def num_prompt_logprobs(self) -> int | None:
        if self.echo_logprobs:
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompt_inputs(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")


def prompt_list(value: str | list[Any], field: str) -> list[str | list[int]]:
    """A body's prompts (field: "prompt", or "input" for embeddings): one text or
    token-id list, or a list of them (at most MAX_PROMPTS_PER_REQUEST), each checked for
    its shape here."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(f"{field} must not be empty", param=field, code="invalid_value")
    if _is_token_ids(value):
        return [value]
    if len(value) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(
            f"{len(value)} {field}s in one request; at most {MAX_PROMPTS_PER_REQUEST}: "
            "split them over several requests",
            param=field,
            code="invalid_value",
        )
    for i, x in enumerate(value):
        if isinstance(x, list) and not x:
            raise APIError(f"{field} {i} must not be empty", param=field, code="invalid_value")
        if not (isinstance(x, str) or (isinstance(x, list) and _is_token_ids(x))):
            raise APIError(
                f"{field} must be a string, a list of token ids, or a list of either "
                f"({field} {i} is neither)",
                param=field,
                code="invalid_type",
            )
    return value


def _is_token_ids(x: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: with --reasoning-parser, whether the answer carries the reasoning.
    include_reasoning: bool = True
    # vLLM's: the answer's text starts with the last message's, when that message is the
    # assistant's (continue_final_message).
    echo: bool = False
    # vLLM's (and transformers'): retrieved documents, for templates that render them.
    documents: list[dict[str, Any]] | None = None
    # OpenAI's legacy function calling: the same as tools and tool_choice (check()).
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # OpenAI's, accepted with no effect here.
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    _UNUSED: ClassVar[tuple[tuple[str, Any], ...]] = (
        *GenerationRequest._UNUSED,
        ("reasoning_effort", None),
        ("verbosity", None),
        ("modalities", ["text"]),
        ("audio", None),
        ("prediction", None),
        ("web_search_options", None),
    )

    def check(self) -> None:
        super().check()
        if self.functions is not None:
            if self.tools is not None:
                raise APIError(
                    "give tools or functions (their older form), not both",
                    param="functions",
                    code="invalid_value",
                )
            self.tools = [ToolDef("function", f) for f in self.functions]
        call = self.function_call
        if call is not None:
            if self.tool_choice is not None:
                raise APIError(
                    "give tool_choice or function_call (its older form), not both",
                    param="function_call",
                    code="invalid_value",
                )
            self.tool_choice = call if isinstance(call, str) else NamedToolChoice("function", call)

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:  # OpenAI refuses it too
                raise APIError(
                    "top_logprobs needs logprobs: true",
                    param="top_logprobs",
                    code="invalid_value",
                )
            return None
        return self.top_logprobs or 0


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /tokenize (vLLM's): a prompt, or a conversation rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # None: as a completion would encode it (the tokenizer's special tokens for a prompt;
    # a rendered conversation already holds its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None  # rendered as a chat completion's would be
    # vLLM's: each token's text beside the ids.
    return_token_strs: bool = False


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/embeddings (OpenAI's, with vLLM's truncate_prompt_tokens and normalize)."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, unused
    truncate_prompt_tokens: int | None = None
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def decode_body(raw: bytes, kind: type[Any], strict: bool = False) -> Any:
    """The request, or an APIError naming the field that is wrong. strict: a field no
    body declares is refused (--strict-request-fields), else ignored with a warning.
    Linear in the body's size, and seconds for the largest allowed: call it off the
    event loop."""
    shape_error = json_shape_error(raw)
    if shape_error is not None:
        raise APIError(shape_error, code="invalid_json")
    try:
        body, unknown = decode_lenient(raw, kind, strict)
    except RecursionError:  # the check above keeps bodies shallower than this
        raise APIError("the body nests too deeply to decode", code="invalid_json") from None
    except msgspec.ValidationError as e:
        text = str(e)
        at = re.search(r"`\$\.(\w+)", text) or re.search(r"field `(\w+)`", text)
        code = "invalid_type"
        if "missing required field" in text:
            code = "missing_required_parameter"
        elif "unknown field" in text:
            code = "unknown_parameter"
        raise APIError(text, param=at.group(1) if at else None, code=code) from None
    except msgspec.DecodeError as e:
        raise APIError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    unused: list[str] = []
    if isinstance(body, GenerationRequest):
        bad = body.unsupported()
        if bad:
            raise APIError(
                f"{', '.join(bad)}: not supported yet by this server (leave at the default)",
                param=bad[0],
                code="unsupported_parameter",
            )
        body.check()
        if debug_enabled():  # the scan costs every request; its line is debug only
            unused = body.unused()
    if unknown or unused:
        log_ignored(kind.__name__, unknown, unused)
    return body
