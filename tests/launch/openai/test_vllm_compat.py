"""Where a client would notice a difference from vLLM's server: each row of
docs/serving.md's table as a request, its status, and its answer's shape and values; the
official `openai` client's typed models parse every answer that is not an error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from launch import LLM, SamplingParams
from tests.helpers.cli_helpers import CPU
from tests.helpers.server import MODEL_NAME, PROMPT_TEXT, TOOLS, Server, post, start_server

CHAT = [{"role": "user", "content": "Hi there"}]

# (route, body, status, the error's param): bodies vLLM refuses with this status.
REFUSED: dict[str, tuple[str, dict[str, Any], int, str]] = {
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "an empty prompt among prompts": ("/v1/completions", {"prompt": ["x", ""]}, 400, "prompt"),
    "empty input": ("/v1/embeddings", {"input": ""}, 400, "input"),
    "an empty input among inputs": ("/v1/embeddings", {"input": ["a", ""]}, 400, "input"),
    "unknown model (completions)": (
        "/v1/completions",
        {"prompt": "x", "model": "gpt-4"},
        404,
        "model",
    ),
    "unknown model (chat)": (
        "/v1/chat/completions",
        {"messages": CHAT, "model": "gpt-4"},
        404,
        "model",
    ),
    "unknown model (embeddings)": (
        "/v1/embeddings",
        {"input": "x", "model": "gpt-4"},
        404,
        "model",
    ),
    "unknown model (responses)": (
        "/v1/responses",
        {"input": "x", "model": "gpt-4"},
        404,
        "model",
    ),
    "unknown model (tokenize)": ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    "temperature above 2": (
        "/v1/completions",
        {"prompt": "x", "temperature": 5},
        400,
        "temperature",
    ),
    "temperature below 0": (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": -0.5},
        400,
        "temperature",
    ),
    "stream_options without stream": (
        "/v1/chat/completions",
        {"messages": CHAT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    "n 2 at temperature 0": (
        "/v1/completions",
        {"prompt": "x", "n": 2, "temperature": 0},
        400,
        "n",
    ),
    "best_of below n": (
        "/v1/completions",
        {"prompt": "x", "n": 3, "best_of": 2, "temperature": 1},
        400,
        "best_of",
    ),
    "functions beside tools": (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": TOOLS, "functions": [TOOLS[0]["function"]]},
        400,
        "functions",
    ),
    "structural_tag set": (
        "/v1/completions",
        {"prompt": "x", "structural_tag": "{}"},
        400,
        "structural_tag",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_vllm_refuses_is_refused_with_its_status(server: Server, case: str) -> None:
    route, body, status, param = REFUSED[case]
    got, answer = post(f"{server.url}{route}", body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    want_type = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["type"] == want_type
    # The server keeps serving.
    assert post(f"{server.url}/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_the_openai_client_raises_its_own_classes_for_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=CHAT)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL_NAME, input=["a", ""])


def _context(server: Server) -> int:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none") as c:
        return c.models.retrieve(MODEL_NAME).max_model_len  # type: ignore[attr-defined]


def test_max_tokens_past_the_context_is_served_up_to_it(server: Server) -> None:
    context = _context(server)
    prompt = [7] * (context - 16)
    body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "model": MODEL_NAME}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200, answer
    Completion.model_validate(answer)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 16
    # A prompt that fills the context alone is still refused.
    status, answer = post(f"{server.url}/v1/completions", {**body, "prompt": [7] * context})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


def test_best_of_is_accepted_and_n_choices_come_back(server: Server) -> None:
    body = {"prompt": "x", "best_of": 2, "max_tokens": 2, "temperature": 1, "seed": 1}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200, answer
    assert len(Completion.model_validate(answer).choices) == 1


def test_max_tokens_0_with_echo_counts_the_token_generated(server: Server) -> None:
    body = {"prompt": PROMPT_TEXT, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200, answer
    # (The first echoed token has no logprob: null, as OpenAI's own answer has it, which
    # the client's typed model declares as a float, so it is not validated here.)
    choice = answer["choices"][0]
    assert choice["text"] == PROMPT_TEXT and choice["logprobs"]["token_logprobs"][0] is None
    assert answer["usage"]["completion_tokens"] == 1  # vLLM's count


# OpenAI's standard fields and vLLM's extensions, sent as null and as values a client
# library fills in: accepted, the answer as without them.
STANDARD_NULL = dict.fromkeys(
    [
        "metadata",
        "store",
        "service_tier",
        "reasoning_effort",
        "modalities",
        "verbosity",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "prediction",
        "functions",
        "function_call",
        "audio",
        "web_search_options",
        "user",
        "request_id",
        "documents",
        "structural_tag",
        "vllm_xargs",
        "kv_transfer_params",
        "add_special_tokens",
    ]
)
STANDARD_SET = {
    "metadata": {"team": "a"},
    "store": False,
    "service_tier": "auto",
    "reasoning_effort": "low",
    "modalities": ["text"],
    "verbosity": "low",
    "prompt_cache_key": "k1",
    "prompt_cache_retention": "in-memory",
    "safety_identifier": "user-1",
    "prediction": {"type": "content", "content": "Hello"},
    "web_search_options": {},
    "user": "u",
    "documents": [{"title": "t", "text": "d"}],
    "spaces_between_special_tokens": True,
    "add_special_tokens": False,
    "vllm_xargs": {"k": 1},
    "kv_transfer_params": {"do_remote_decode": False},
    "echo": False,
    "return_tokens_as_token_ids": False,
}


@pytest.mark.parametrize("fields", [STANDARD_NULL, STANDARD_SET], ids=["null", "set"])
def test_standard_fields_are_accepted_and_change_nothing(
    server: Server, fields: dict[str, Any]
) -> None:
    base = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "model": MODEL_NAME}
    status, plain = post(f"{server.url}/v1/chat/completions", base)
    assert status == 200, plain
    status, answer = post(f"{server.url}/v1/chat/completions", {**base, **fields})
    assert status == 200, answer
    ChatCompletion.model_validate(answer)
    assert answer["choices"][0]["message"] == plain["choices"][0]["message"]
    # Completions takes the ones it shares; the chat-only ones are ignored as unknown.
    completion = {"prompt": "x", "max_tokens": 2, "temperature": 0, "best_of": None}
    status, answer = post(f"{server.url}/v1/completions", {**completion, **fields})
    assert status == 200, answer
    Completion.model_validate(answer)


def test_an_unknown_field_is_ignored(server: Server) -> None:
    body = {"prompt": "x", "max_tokens": 1, "bogus": 1, "stream_options": None}
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200, answer
    # Nested too: an unknown field inside a known object.
    chat = {"messages": CHAT, "max_tokens": 1, "response_format": {"type": "text", "new": 1}}
    status, answer = post(f"{server.url}/v1/chat/completions", {**chat, "x": 2})
    assert status == 200, answer
    # What is left once they are gone is checked as ever.
    status, answer = post(f"{server.url}/v1/completions", {**body, "temperature": 9})
    assert status == 400 and answer["error"]["param"] == "temperature", answer
    status, answer = post(
        f"{server.url}/v1/responses", {"input": "a", "max_output_tokens": 1, "y": 0}
    )
    assert status == 200, answer
    status, answer = post(f"{server.url}/v1/embeddings", {"input": "a", "encoding": "x"})
    assert status == 200, answer
    CreateEmbeddingResponse.model_validate(answer)


def test_strict_request_fields_refuses_unknown_fields(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server("--strict-request-fields")
    body = {"prompt": "x", "max_tokens": 1}
    status, answer = post(f"{server.url}/v1/completions", {**body, "bogus": 1})
    assert status == 400 and answer["error"]["code"] == "unknown_parameter", answer
    assert answer["error"]["param"] == "bogus"
    # Declared fields, also null, are not unknown.
    status, answer = post(f"{server.url}/v1/completions", {**body, "metadata": None})
    assert status == 200, answer


def test_vllm_extensions_are_honoured(server: Server) -> None:
    url = f"{server.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    status, answer = post(url, {**body, "return_tokens_as_token_ids": True, "request_id": "r-1"})
    assert status == 200, answer
    assert answer["id"] == "cmpl-r-1"
    ids = post(url, {**body, "return_token_ids": True})[1]["choices"][0]["token_ids"]
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in ids]
    status, answer = post(url, {**body, "request_id": "bad id!"})
    assert status == 400 and answer["error"]["param"] == "request_id", answer
    status, answer = post(
        f"{server.url}/tokenize", {"prompt": "Hi there", "return_token_strs": True}
    )
    assert status == 200 and len(answer["token_strs"]) == answer["count"], answer
    # Chat's echo: an answer continuing the assistant's message starts with it.
    turn = [*CHAT, {"role": "assistant", "content": "Well"}]
    chat = {"messages": turn, "max_tokens": 2, "temperature": 0, "add_generation_prompt": False}
    chat["continue_final_message"] = True
    plain = post(f"{server.url}/v1/chat/completions", chat)[1]
    echoed = post(f"{server.url}/v1/chat/completions", {**chat, "echo": True})[1]
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Well" + text


# A template that adds the content as a string, as most models' templates do.
CONCAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role + ':' + m.content }}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<{{ c.function.name }}>{% endfor %}{% endif %}\n{% endfor %}"
)


def test_a_tool_round_trip_sends_back_content_none(builtin_server: Callable[..., Server]) -> None:
    server = builtin_server("--chat-template", CONCAT_TEMPLATE, "--tool-call-parser", "hermes")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(model="pagedserve-builtin", tools=TOOLS, temperature=0)
    ask = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(messages=ask, tool_choice=named, max_tokens=60, **args)
    message = first.choices[0].message
    assert message.content is None and message.tool_calls
    call = message.tool_calls[0]
    # What the openai client's users send back: the message as the client parsed it.
    back = message.model_dump(exclude_unset=True)
    assert back["content"] is None
    turns = [*ask, back, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(messages=turns, max_tokens=3, **args)
    assert second.choices[0].message.role == "assistant"
    # functions / function_call, OpenAI's older form, call the same function.
    fn = TOOLS[0]["function"]
    legacy = post(
        f"{server.url}/v1/chat/completions",
        {
            "messages": ask,
            "functions": [fn],
            "function_call": {"name": fn["name"]},
            "max_tokens": 60,
            "temperature": 0,
        },
    )[1]
    ChatCompletion.model_validate(legacy)
    (legacy_call,) = legacy["choices"][0]["message"]["tool_calls"]
    assert legacy_call["function"]["name"] == "get_weather"
    assert json.loads(legacy_call["function"]["arguments"]) == json.loads(call.function.arguments)


def test_the_real_model_starts_without_a_length_flag(real_model_dir: Path, tmp_path: Path) -> None:
    """LLM(path) and `pagedserve serve --model DIR` on the default CPU KV budget: the
    length fits itself (the model's context when one request of it fits, else less)."""
    context = json.loads((real_model_dir / "config.json").read_text())["max_position_embeddings"]
    with LLM(str(real_model_dir), device=CPU) as llm:
        fitted = llm.max_model_len
        assert 0 < fitted <= context
        (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out.token_ids
    server = start_server(real_model_dir, tmp_path)
    try:
        assert _context(server) == fitted
    finally:
        server.stop()
