"""The OpenAI-compatible request bodies: decoded and checked once, at the boundary.

A completions `prompt` is a text, a list of token ids, or a list of up to
MAX_PROMPTS_PER_REQUEST of either (each its own engine request, answered as choices
prompt-major); every prompt is checked before any is sent.

Bodies are msgspec Structs with unknown fields refused, so a typo or an option this
engine does not implement is a 400 naming the field, never silently ignored. Options the
engine does not support (suffix, best_of) are accepted only at their neutral values.
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

import asyncio
import re
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from launch.client.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from launch.openai.tools import ToolChoice, ToolDef
from protocol.engine import Logprobs, SamplingParams, StructuredOutputs
from worker.structured_output import grammar_of

# OpenAI's legacy completions default; chat completions default to the context left.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Prompts in one completions request (a list of texts or token-id lists): each is its own
# engine request (n of them with n > 1), all checked before any is sent. Bounded so one
# body cannot queue an unbounded batch behind a single admission check.
MAX_PROMPTS_PER_REQUEST = 128


_json = msgspec.json.Encoder()
# JSON may carry U+0085, U+2028 and U+2029 raw, but line readers that split like
# str.splitlines (httpx's iter_lines, for one) end a line there, inside an event: such
# a client loses the token. Escaped, the JSON decodes to the same text. (In UTF-8 these
# byte pairs and triples occur only as these characters.)
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(body: object, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (after `event: <name>` when named, as the
    Responses API's are) and a blank line, no line break inside."""
    data = _json.encode(body)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    if event is not None:
        return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


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


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # vLLM's extension: lower runs first under --scheduling-policy priority.
    priority: int = 0
    return_token_ids: bool = False
    user: str | None = None  # accepted, unused
    n: int = 1
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # OpenAI's: token ids (as JSON keys, strings of digits) to values in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # vLLM's: the prompt's tokens with their logprobs and that many alternatives.
    prompt_logprobs: int | None = None
    # The output kept inside a language: OpenAI's response_format, or vLLM's extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's: beam search instead of sampling, n beams wide (launch/client/beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: streamed chunks carry at least this many tokens (the server's, if larger).
    stream_interval: int | None = None

    def unsupported(self) -> list[str]:
        """The options set to something this engine cannot do yet."""
        return []

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


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, 1):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

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


class ChatCompletionRequest(_Request, kw_only=True):
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


def decode_body(
    raw: bytes, kind: type[_Request] | type[TokenizeRequest] | type[DetokenizeRequest]
) -> Any:
    """The request, or an APIError naming the field that is wrong."""
    try:
        body = msgspec.json.decode(raw, type=kind)
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
    bad = body.unsupported() if isinstance(body, _Request) else []
    if bad:
        raise APIError(
            f"{', '.join(bad)}: not supported yet by this server (leave at the default)",
            param=bad[0],
            code="unsupported_parameter",
        )
    return body


def sampling_params(
    body: _Request,
    max_tokens: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    which: str = "the prompt",
    has_tokenizer: bool = True,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for body, checked; max_tokens None: default. which
    names the prompt in errors ("prompt 3" of several); has_tokenizer: whether the model
    has one (structured outputs need it); constraint: the language tool_choice holds the
    output to (launch/openai/tools.py), which excludes the body's own."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(
            f"{which} has {num_prompt_tokens} tokens; this model's context is "
            f"{max_model_len} tokens, leaving none to generate",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        chat = isinstance(body, ChatCompletionRequest)
        max_tokens = room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens > room and max_tokens >= 1:
        raise APIError(
            f"this model's context is {max_model_len} tokens, but {num_prompt_tokens} "
            f"({which}) + {max_tokens} (max_tokens) were asked for",
            param="max_tokens",
            code="context_length_exceeded",
        )
    structured, structured_param = structured_spec(body, constraint)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words or [],
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        n=body.n,
        stop=body.stop_strings(),
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logprobs=body.num_logprobs(),
        logit_bias=body.logit_bias or None,
        prompt_logprobs=body.num_prompt_logprobs(),
        structured_outputs=structured,
    )
    try:
        params.validate(vocab_size)
    except ValueError as e:
        param = str(e).split()[0]
        if param == "logprobs" and isinstance(body, ChatCompletionRequest):
            param = "top_logprobs"
        elif param == "structured_outputs":
            param = structured_param
        raise APIError(str(e), param=param, code="invalid_value") from None
    if structured is not None:
        if not has_tokenizer:
            raise APIError(
                f"{structured_param}: this model has no tokenizer (tokenizer.json), which "
                "structured outputs need",
                param=structured_param,
                code="invalid_value",
            )
        try:
            grammar_of(structured)
        except ValueError as e:
            raise APIError(str(e), param=structured_param, code="invalid_value") from None
    return params


def beam_search_params(
    body: _Request, params: list[SamplingParams], tools: bool
) -> BeamSearchParams:
    """use_beam_search's parameters, once sampling_params() checked the body's (one per
    prompt): n is the beam width, max_tokens the prompts' least. APIError naming the first
    option set that beam search cannot honour (tools: the chat's tools may answer)."""
    fmt = body.response_format
    conflicts = (
        ("stop", bool(body.stop_strings())),
        ("stop_token_ids", bool(body.stop_token_ids)),
        ("bad_words", bool(body.bad_words)),
        ("allowed_token_ids", body.allowed_token_ids is not None),
        ("logit_bias", bool(body.logit_bias)),
        ("presence_penalty", body.presence_penalty != 0.0),
        ("frequency_penalty", body.frequency_penalty != 0.0),
        ("repetition_penalty", body.repetition_penalty != 1.0),
        ("min_tokens", body.min_tokens != 0),
        ("top_p", body.top_p not in (None, 1.0)),
        ("top_k", body.top_k not in (None, 0)),
        ("min_p", body.min_p not in (None, 0.0)),
        ("seed", body.seed is not None),
        ("response_format", fmt is not None and fmt.type != "text"),
        ("structured_outputs", body.structured_outputs is not None),
        ("prompt_logprobs", body.num_prompt_logprobs() is not None),
        ("tools", tools),
    )
    for name, conflict in conflicts:
        if conflict:
            raise APIError(
                f"{name} cannot be used with use_beam_search", param=name, code="invalid_value"
            )
    width = params[0].n
    if width > MAX_BEAM_WIDTH:
        raise APIError(
            f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}, got {width}",
            param="n",
            code="invalid_value",
        )
    beam = BeamSearchParams(
        beam_width=width,
        max_tokens=min(p.max_tokens for p in params),
        ignore_eos=body.ignore_eos,
        temperature=body.temperature or 0.0,
        length_penalty=body.length_penalty,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )
    try:
        beam.validate()
    except ValueError as e:
        raise APIError(str(e), param=str(e).split()[0], code="invalid_value") from None
    return beam


def structured_spec(
    body: _Request, constraint: StructuredOutputs | None
) -> tuple[StructuredOutputs | None, str]:
    """The language the output is held to (the body's, or tool_choice's constraint; not
    both) and the field that asked for it."""
    structured, param = body.structured()
    if constraint is None:
        return structured, param
    if structured is not None:
        raise APIError(
            f"tool_choice holds the output to the tool's arguments: it cannot be "
            f"combined with {param}",
            param="tool_choice",
            code="invalid_value",
        )
    return constraint, "tool_choice"


async def precompile(body: _Request, constraint: StructuredOutputs | None) -> None:
    """The output's language converted and checked on a thread (llguidance drops the GIL;
    a schema of a few hundred properties takes tens of ms, which would stall every
    stream), so that sampling_params finds it cached."""
    spec, param = structured_spec(body, constraint)
    if spec is None:
        return
    try:
        await asyncio.to_thread(grammar_of, spec)
    except ValueError as e:
        raise APIError(str(e), param=param, code="invalid_value") from None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[Logprobs],
    token_text: Callable[[int], str],
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions shape for some tokens of a choice; text_offset is where the
    first starts in the choice's text (offsets add up each token's own text)."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for t, lp in zip(token_ids, logprobs):
        text = token_text(t)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top: dict[str, float] = {}
        # Tokens whose texts coincide keep the likeliest's logprob; the chosen token is
        # always listed (as vLLM does).
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(token_text(i), v)
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    token_ids: list[int], logprobs: list[Logprobs | None], token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else a map of token
    ids (the prompt's own, then the likeliest) to {logprob, decoded_token}."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for t, lp in zip(token_ids, logprobs):
        if lp is None:
            out.append(None)
            continue
        entries = {str(t): {"logprob": lp.logprob, "decoded_token": token_text(t)}}
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            entries.setdefault(str(i), {"logprob": v, "decoded_token": token_text(i)})
        out.append(entries)
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[Logprobs], token_text: Callable[[int], str]
) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def entry(t: int, logprob: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for t, lp in zip(token_ids, logprobs):
        item = entry(t, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}
