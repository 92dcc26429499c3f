"""The routes beside chat completions, on a real trained model (SmolLM2-135M-Instruct):
greedy messages carry the same text and token counts as the chat completion of the same
conversation, whole and streamed, and a turn the model ends itself is end_turn; the
token-in/token-out route, fed the chat's rendered prompt, samples the chat's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.types import Message

from tests.helpers.server import MODEL_NAME, Server, post, start_server

MAX_TOKENS = 32
CHATS = [
    ("You are a helpful assistant.", [{"role": "user", "content": "Say hello in one word."}]),
    (
        "Answer briefly.",
        [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
    ),
]


@pytest.fixture(scope="module")
def server(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(real_model_dir, tmp_path_factory.mktemp("real"), "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.mark.parametrize(("system", "turns"), CHATS)
def test_greedy_messages_equal_chat_on_the_real_model(
    server: Server, system: str, turns: list[dict[str, Any]]
) -> None:
    conversation = [{"role": "system", "content": system}, *turns]
    body = {"model": MODEL_NAME, "messages": conversation, "temperature": 0}
    status, chat = post(f"{server.url}/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS})
    assert status == 200, chat
    choice = chat["choices"][0]
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    args: dict[str, Any] = dict(
        model=MODEL_NAME,
        max_tokens=MAX_TOKENS,
        system=system,
        messages=turns,
        extra_body={"temperature": 0},
    )
    raw = client.messages.with_raw_response.create(**args)
    m = Message.model_validate(raw.http_response.json())
    assert [b.text for b in m.content] == [choice["message"]["content"]]  # type: ignore[union-attr]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    prompt = chat["usage"]["prompt_tokens"]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == prompt
    want = {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert m.stop_reason == want
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [b.text for b in m.content]  # type: ignore[union-attr]
    assert final.stop_reason == want
    counted = client.messages.count_tokens(model=MODEL_NAME, system=system, messages=turns)  # type: ignore[arg-type]
    assert counted.input_tokens == prompt


def test_a_short_answer_ends_its_turn(server: Server) -> None:
    """The model's own end of turn is end_turn (the first chat ends well inside 32 tokens)."""
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    system, turns = CHATS[0]
    m = client.messages.create(
        model=MODEL_NAME,
        max_tokens=MAX_TOKENS,
        system=system,
        messages=turns,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "end_turn" and m.usage.output_tokens < MAX_TOKENS
    assert m.content[0].text.strip()  # type: ignore[union-attr]


@pytest.mark.parametrize(("system", "turns"), CHATS)
def test_token_in_token_out_equals_chat_and_completions_on_the_real_model(
    server: Server, system: str, turns: list[dict[str, Any]]
) -> None:
    """render -> /inference/v1/generate gives the chat's greedy tokens, and the same ids
    as /v1/completions of the rendered prompt ids."""
    conversation = [{"role": "system", "content": system}, *turns]
    body = {"model": MODEL_NAME, "messages": conversation, "temperature": 0}
    chat_body = {**body, "max_tokens": MAX_TOKENS, "logprobs": True}
    status, chat = post(f"{server.url}/v1/chat/completions", chat_body)
    assert status == 200, chat
    status, rendered = post(f"{server.url}/v1/chat/completions/render", chat_body)
    assert status == 200, rendered
    status, generated = post(f"{server.url}/inference/v1/generate", rendered)
    assert status == 200, generated
    ids = generated["choices"][0]["token_ids"]
    assert len(ids) == chat["usage"]["completion_tokens"]
    status, text = post(f"{server.url}/detokenize", {"tokens": ids})
    assert status == 200 and text["prompt"] == chat["choices"][0]["message"]["content"]
    prompt = {"prompt": rendered["token_ids"], "max_tokens": MAX_TOKENS, "temperature": 0}
    status, completion = post(f"{server.url}/v1/completions", {"model": MODEL_NAME, **prompt})
    assert status == 200, completion
    assert completion["usage"]["completion_tokens"] == len(ids)
    assert completion["choices"][0]["text"] == text["prompt"]


def test_text_parts_chat_equals_string_chat_on_the_real_model(server: Server) -> None:
    """SmolLM2's template adds content to a string: text parts (what OpenAI's clients and
    vLLM's benchmark send) are joined for it, so both forms give the same answer."""
    answers = []
    for content in ("What is 2+2?", [{"type": "text", "text": "What is 2+2?"}]):
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        }
        status, chat = post(f"{server.url}/v1/chat/completions", body)
        assert status == 200, chat
        answers.append(chat["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]
