"""POST /v1/completions (serving_completions.py): several prompts, echo, stream
intervals, bad bodies as OpenAI's 400s, priorities."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.helpers.server import (
    EXTRA,
    MODEL_NAME,
    PROMPT_IDS,
    PROMPT_TEXT,
    N,
    Server,
    post,
)


def test_a_stream_interval_sends_tokens_in_chunks(
    server: Server, client: openai.OpenAI, builtin_server: Callable[..., Server]
) -> None:
    """vLLM's stream_interval, a request's or the server's (--stream-interval): chunks of at
    least that many tokens but the first and the last, the same tokens in the same order."""

    def sizes(c: openai.OpenAI, model: str, extra: dict) -> tuple[list[int], list[int]]:
        chunks = c.completions.create(
            model=model,
            prompt=PROMPT_IDS,
            max_tokens=N,
            temperature=0,
            stream=True,
            extra_body={**EXTRA, **extra},
        )
        got = [ch.choices[0].token_ids for ch in chunks if ch.choices[0].token_ids]  # type: ignore
        return [len(ids) for ids in got], [t for ids in got for t in ids]

    one, ids = sizes(client, MODEL_NAME, {})
    four, ids4 = sizes(client, MODEL_NAME, {"stream_interval": 4})
    assert ids4 == ids and len(one) == N
    assert four[0] == 1 and all(k >= 4 for k in four[1:-1]) and len(four) <= 2 + (N - 1) // 4
    status, err = post(
        f"{server.url}/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "stream_interval": 0},
    )
    assert status == 400 and err["error"]["param"] == "stream_interval"
    builtin = builtin_server("--stream-interval", "3")
    c = openai.OpenAI(base_url=f"{builtin.url}/v1", api_key="none", max_retries=0)
    three, _ = sizes(c, "pagedserve-builtin", {})
    assert three[0] == 1 and all(k >= 3 for k in three[1:-1]) and len(three) <= 2 + (N - 1) // 3
    # A request may ask for more than the server's, not less.
    asked_less, _ = sizes(c, "pagedserve-builtin", {"stream_interval": 1})
    assert all(k >= 3 for k in asked_less[1:-1])


def test_several_prompts_in_one_request_are_answered_prompt_major(
    server: Server, client: openai.OpenAI, reference: dict[str, list[int]]
) -> None:
    args = dict(model=MODEL_NAME, max_tokens=N, temperature=0, extra_body=EXTRA)
    c = client.completions.create(prompt=[PROMPT_TEXT, PROMPT_IDS], **args)
    assert [ch.index for ch in c.choices] == [0, 1]
    assert [ch.token_ids for ch in c.choices] == [reference["text"], reference["ids"]]  # type: ignore[attr-defined]
    prompts = [ch.prompt_token_ids for ch in c.choices]  # type: ignore[attr-defined]
    assert prompts[1] == PROMPT_IDS
    assert c.usage is not None and c.usage.completion_tokens == 2 * N
    assert c.usage.prompt_tokens == sum(map(len, prompts))
    # Streamed with n=2: choice index = prompt * 2 + copy, usage summed at the end. top_k
    # 1 samples greedily (n > 1 at temperature 0 is refused, as vLLM refuses it).
    stream = client.completions.create(
        prompt=[PROMPT_TEXT, PROMPT_IDS],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **{**args, "temperature": 1.0, "extra_body": {**EXTRA, "top_k": 1}},  # type: ignore[arg-type]
    )
    ids: dict[int, list[int]] = {i: [] for i in range(4)}
    finished = set()
    for chunk in stream:
        for ch in chunk.choices:
            ids[ch.index] += ch.token_ids  # type: ignore[attr-defined]
            if ch.finish_reason is not None:
                finished.add(ch.index)
        usage = chunk.usage
    want = [reference["text"]] * 2 + [reference["ids"]] * 2
    assert [ids[i] for i in range(4)] == want and finished == {0, 1, 2, 3}
    assert usage is not None and usage.completion_tokens == 4 * N
    assert usage.prompt_tokens == sum(map(len, prompts))  # each prompt once, not n times
    # Cached tokens add up over the prompts: 2 full blocks of 16 each, the second time.
    long = [list(range(20, 60)), list(range(60, 100))]
    first, again = (client.completions.create(prompt=long, **args) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens == 64  # type: ignore[union-attr]
    assert again.usage.prompt_tokens == 80  # type: ignore[union-attr]


BAD_BODIES = {
    "missing prompt": ({"max_tokens": 3}, "prompt", "missing_required_parameter"),
    "negative max_tokens": ({"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    "prompt too long": ({"prompt": [7] * 300}, "prompt", "context_length_exceeded"),
    "wrong type": ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "invalid_type"),
    "prompt of floats": ({"prompt": [1.5]}, "prompt", "invalid_type"),
    "token outside the vocabulary": ({"prompt": [10**6]}, "prompt", "invalid_value"),
    "logprobs > 20": ({"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    "n too large": ({"prompt": "x", "n": 17}, "n", "invalid_value"),
    "5 stop strings": ({"prompt": "x", "stop": list("abcde")}, "stop", "invalid_value"),
    "penalty": ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    "logit_bias out of range": (
        {"prompt": "x", "logit_bias": {"5": 101}},
        "logit_bias",
        "invalid_value",
    ),
    "suffix": ({"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    "top_p": ({"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    # The server runs the default fcfs policy: only priority 0 is served.
    "priority without its policy": ({"prompt": "x", "priority": 3}, "priority", "invalid_value"),
    "priority not an integer": ({"prompt": "x", "priority": "high"}, "priority", "invalid_type"),
    # Several prompts: one bad one refuses the whole request before any is sent.
    "a bad token among prompts": ({"prompt": ["x", [10**6]]}, "prompt", "invalid_value"),
    "a prompt too long among prompts": (
        {"prompt": [[7] * 2, [7] * 300]},
        "prompt",
        "context_length_exceeded",
    ),
    "an empty prompt among prompts": ({"prompt": ["x", []]}, "prompt", "invalid_value"),
    "a number among text prompts": ({"prompt": ["x", 5]}, "prompt", "invalid_type"),
    "too many prompts": ({"prompt": ["x"] * 129}, "prompt", "invalid_value"),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_a_bad_body_is_an_openai_400_and_the_server_keeps_serving(
    server: Server, case: str
) -> None:
    body, param, code = BAD_BODIES[case]
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert code is None or error["code"] == code
    good = {"prompt": PROMPT_IDS, "max_tokens": 2, "stop": [], "model": MODEL_NAME}
    assert post(f"{server.url}/v1/completions", good)[0] == 200


def test_echo_puts_each_prompt_before_its_completions(
    server: Server, client: openai.OpenAI, chat_model: Path
) -> None:
    from tokenizers import Tokenizer

    decode = Tokenizer.from_file(str(chat_model / "tokenizer.json")).decode
    args = dict(model=MODEL_NAME, max_tokens=N, temperature=0, extra_body=EXTRA)
    plain = client.completions.create(prompt=[PROMPT_TEXT, PROMPT_IDS], **args)
    echoed = client.completions.create(prompt=[PROMPT_TEXT, PROMPT_IDS], echo=True, **args)
    prompts = [PROMPT_TEXT, decode(PROMPT_IDS)]
    for c, p, e in zip(plain.choices, prompts, echoed.choices):
        assert e.text == p + c.text and e.model_extra["token_ids"] == c.model_extra["token_ids"]
    assert echoed.usage == plain.usage  # the echo is text, not tokens
    chunks = list(client.completions.create(prompt=PROMPT_TEXT, echo=True, stream=True, **args))
    assert "".join(ch.choices[0].text for ch in chunks) == PROMPT_TEXT + plain.choices[0].text
    # With logprobs the prompt's tokens lead them (test_sampling_options); streamed, the
    # echo waits for the first token, which brings them, and the chunks add up the same.
    scored = dict(prompt=PROMPT_TEXT, echo=True, logprobs=2, **args)
    whole = client.completions.create(**scored).choices[0]  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **scored))  # type: ignore[call-overload]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert whole.logprobs is not None and whole.logprobs.tokens is not None
    assert [t for lp in streamed for t in lp.tokens or []] == whole.logprobs.tokens
    assert [t for lp in streamed for t in lp.text_offset or []] == whole.logprobs.text_offset
    got = [t for lp in streamed for t in lp.token_logprobs or []]
    want = whole.logprobs.token_logprobs or []
    assert got[0] is None and want[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)


def test_a_server_on_the_priority_policy_takes_priorities(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server("--scheduling-policy", "priority")
    greedy = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answers = [post(f"{server.url}/v1/completions", greedy | {"priority": p}) for p in (0, -5, 7)]
    assert all(status == 200 for status, _ in answers), answers
    # Greedy: the priority changes when a request runs, never what it generates.
    assert len({a["choices"][0]["text"] for _, a in answers}) == 1
    assert all(a["usage"]["completion_tokens"] == 4 for _, a in answers)
    status, answer = post(f"{server.url}/v1/completions", greedy | {"priority": 1.5})
    assert status == 400 and answer["error"]["param"] == "priority", answer
