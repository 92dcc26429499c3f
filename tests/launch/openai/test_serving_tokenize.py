"""vLLM's /tokenize and /detokenize (serving_tokenize.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai

from tests.helpers.model_files import CONVERSATION, FANCY
from tests.helpers.server import (
    EXTRA,
    MODEL_NAME,
    PROMPT_TEXT,
    Server,
    post,
)


def test_tokenize_and_detokenize_give_what_generation_uses(
    server: Server, client: openai.OpenAI, chat_model: Path
) -> None:
    """vLLM's /tokenize and /detokenize: the ids a completion or a chat completion sends
    (checked against the answers' own prompt_token_ids and against transformers), and
    text back from ids; bad bodies are 400s."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(chat_model / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    status, text = post(f"{server.url}/tokenize", {"model": MODEL_NAME, "prompt": PROMPT_TEXT})
    assert status == 200, text
    assert (
        text["tokens"]
        == Tokenizer.from_file(str(chat_model / "tokenizer.json")).encode(PROMPT_TEXT).ids
    )
    assert text["count"] == len(text["tokens"]) and text["max_model_len"] == 256
    c = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT_TEXT, max_tokens=1, extra_body=EXTRA
    )
    assert c.prompt_token_ids == text["tokens"]  # type: ignore[attr-defined]
    status, chat = post(f"{server.url}/tokenize", {"messages": CONVERSATION})
    want = hf.apply_chat_template(
        CONVERSATION, chat_template=FANCY, tokenize=False, add_generation_prompt=True
    )
    assert status == 200 and chat["tokens"] == hf.encode(want, add_special_tokens=False)
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CONVERSATION,
        max_tokens=1,
        extra_body=EXTRA,  # type: ignore
    )
    assert r.prompt_token_ids == chat["tokens"]  # type: ignore[attr-defined]
    # A reply begun for the model, which continues it (vLLM's continue_final_message).
    begun = [*CONVERSATION[:2], {"role": "assistant", "content": "2 +"}]
    want = hf.apply_chat_template(
        begun, chat_template=FANCY, tokenize=False, continue_final_message=True
    )
    body = {"messages": begun, "continue_final_message": True, "add_generation_prompt": False}
    status, cont = post(f"{server.url}/tokenize", body)
    assert status == 200 and cont["tokens"] == hf.encode(want, add_special_tokens=False)
    status, answer = post(f"{server.url}/v1/chat/completions", {**body, **EXTRA, "max_tokens": 1})
    assert status == 200 and answer["prompt_token_ids"] == cont["tokens"], answer
    status, answer = post(
        f"{server.url}/v1/chat/completions", {**body, "add_generation_prompt": True}
    )
    assert status == 400 and "add_generation_prompt" in answer["error"]["message"], answer
    status, back = post(f"{server.url}/detokenize", {"tokens": text["tokens"]})
    assert status == 200 and back["prompt"] == hf.decode(text["tokens"])
    for url, body, param in (
        ("tokenize", {"prompt": "x", "messages": CONVERSATION}, None),
        ("tokenize", {}, None),
        ("tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ("detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("detokenize", {"tokens": "abc"}, "tokens"),
    ):
        status, answer = post(f"{server.url}/{url}", body)
        assert status == 400 and answer["error"]["param"] == param, (url, body, answer)
    with urllib.request.urlopen(f"{server.url}/version", timeout=60) as v:
        assert json.loads(v.read())["version"]
