"""A generation body turned into the engine's SamplingParams (and use_beam_search's
BeamSearchParams), every option checked, errors naming the body's field."""

from __future__ import annotations

import asyncio

from launch.client.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from launch.openai.protocol import APIError, ChatCompletionRequest, GenerationRequest
from protocol.engine import SamplingParams, StructuredOutputs
from worker.structured_output import grammar_of

# OpenAI's legacy completions default; chat completions default to the context left.
DEFAULT_COMPLETION_MAX_TOKENS = 16


def sampling_params(
    body: GenerationRequest,
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
    max_tokens = _max_tokens(body, max_tokens, num_prompt_tokens, max_model_len, which)
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
    # Checked here as well as by the client (inputs.checked_params): a bad body must be a
    # 400 naming its field before admission's 503s and before a beam search streams.
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


def _max_tokens(
    body: GenerationRequest,
    max_tokens: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    which: str,
) -> int:
    """max_tokens, or the endpoint's default, capped at the room the prompt leaves (as
    vLLM does: the answer stops by length there); only a prompt that fills the context is
    refused."""
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
    elif max_tokens > room:
        max_tokens = room
    return max_tokens


def beam_search_params(
    body: GenerationRequest, params: list[SamplingParams], tools: bool
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
    body: GenerationRequest, constraint: StructuredOutputs | None
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


async def precompile(body: GenerationRequest, constraint: StructuredOutputs | None) -> None:
    """The output's language converted and checked on a thread (llguidance drops the GIL;
    a large schema's compile on the event loop would stall every stream), so that
    sampling_params finds it cached."""
    spec, param = structured_spec(body, constraint)
    if spec is None:
        return
    try:
        await asyncio.to_thread(grammar_of, spec)
    except ValueError as e:
        raise APIError(str(e), param=param, code="invalid_value") from None
