"""Token-in/token-out generation (POST /inference/v1/generate) and prompt rendering (POST
/v1/chat/completions/render, /v1/completions/render) on a real server: the ids generated
are the ones /v1/completions generates for the same prompt ids, rendering gives the ids
/tokenize and the chat route use, and a rendered request generates as its chat would."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import MODEL_NAME, PROMPT_IDS, Server, post

N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


def _completion_ids(server: Server, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "return_token_ids": True, **GREEDY}
    status, answer = post(f"{server.url}/v1/completions", {**body, **extra})
    assert status == 200, answer
    return answer


def _generate(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post(f"{server.url}/inference/v1/generate", body)
    assert status == 200, answer
    return answer


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        lines = [line.decode().strip() for line in r]
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_generate_greedy_equals_completions_for_the_same_prompt_ids(server: Server) -> None:
    want = _completion_ids(server)["choices"][0]["token_ids"]
    answer = _generate(
        server,
        {"token_ids": PROMPT_IDS, "sampling_params": GREEDY, "request_id": "rl-7"},
    )
    assert answer["request_id"] == "rl-7" and answer["model"] == MODEL_NAME
    (choice,) = answer["choices"]
    assert choice == {"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": want}
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT_IDS), N)


def test_generate_logprobs_name_tokens_by_id_and_match_completions(server: Server) -> None:
    want = _completion_ids(server, logprobs=2)["choices"][0]
    answer = _generate(
        server, {"token_ids": PROMPT_IDS, "sampling_params": {**GREEDY, "logprobs": 2}}
    )
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in want["token_ids"]]
    assert [c["logprob"] for c in content] == pytest.approx(want["logprobs"]["token_logprobs"])
    assert all(len(c["top_logprobs"]) == 2 for c in content)


def test_generate_streams_token_ids_then_usage_then_done(server: Server) -> None:
    want = _completion_ids(server)["choices"][0]["token_ids"]
    body = {
        "token_ids": PROMPT_IDS,
        "sampling_params": GREEDY,
        "stream": True,
        "stream_options": {"include_usage": True},
        "request_id": "s1",
    }
    chunks = _events(f"{server.url}/inference/v1/generate", body)
    *deltas, last = chunks
    assert all(c["request_id"] == "s1" for c in chunks)
    assert [t for c in deltas for t in c["choices"][0]["token_ids"]] == want
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == N


def test_generate_without_max_tokens_may_use_the_whole_context(server: Server) -> None:
    context = post(f"{server.url}/tokenize", {"prompt": "x"})[1]["max_model_len"]
    params = {"temperature": 0, "ignore_eos": True}
    answer = _generate(server, {"token_ids": PROMPT_IDS, "sampling_params": params})
    assert len(answer["choices"][0]["token_ids"]) == context - len(PROMPT_IDS)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [10**9]}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": -1}},
            "sampling_params.max_tokens",
        ),
        ({"token_ids": [1], "sampling_params": {"n": "two"}}, "sampling_params"),
        ({"token_ids": [1], "features": "x"}, "features"),
        ({"sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "request_id": "r" * 513}, "request_id"),
        ({"token_ids": [1], "priority": 1}, "priority"),
    ],
)
def test_a_bad_generate_body_is_a_400_naming_its_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    status, answer = post(f"{server.url}/inference/v1/generate", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_generate_for_another_model_is_refused(server: Server) -> None:
    status, answer = post(f"{server.url}/inference/v1/generate", {"token_ids": [1], "model": "x"})
    assert status in (400, 404) and answer["error"]["param"] == "model"


def test_chat_render_gives_the_ids_tokenize_and_the_chat_route_use(server: Server) -> None:
    status, rendered = post(
        f"{server.url}/v1/chat/completions/render",
        {"model": MODEL_NAME, "messages": CONVERSATION, **GREEDY},
    )
    assert status == 200, rendered
    tokenized = post(f"{server.url}/tokenize", {"messages": CONVERSATION})[1]["tokens"]
    chat = post(
        f"{server.url}/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CONVERSATION, "return_token_ids": True, **GREEDY},
    )[1]
    assert rendered["token_ids"] == tokenized == chat["prompt_token_ids"]
    assert rendered["model"] == MODEL_NAME and rendered["features"] is None
    sp = rendered["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["ignore_eos"]) == (N, 0, True)
    # What render answers is a generate request: it generates what the chat generated.
    generated = _generate(server, rendered)
    assert generated["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]


def test_completions_render_gives_one_request_per_prompt(server: Server) -> None:
    status, rendered = post(
        f"{server.url}/v1/completions/render",
        {"model": MODEL_NAME, "prompt": ["2 + 2", PROMPT_IDS], "max_tokens": 3},
    )
    assert status == 200, rendered
    first = post(f"{server.url}/tokenize", {"prompt": "2 + 2"})[1]["tokens"]
    assert [r["token_ids"] for r in rendered] == [first, PROMPT_IDS]
    assert all(r["sampling_params"]["max_tokens"] == 3 for r in rendered)


def test_render_of_a_bad_conversation_is_a_400(server: Server) -> None:
    status, answer = post(
        f"{server.url}/v1/chat/completions/render", {"messages": [{"role": "robot"}]}
    )
    assert status == 400 and answer["error"]["param"] == "messages", answer
