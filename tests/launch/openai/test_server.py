"""`pagedserve serve` as clients use it: real processes, the official `openai` client,
raw HTTP where a client must misbehave (malformed bodies, disconnecting mid-stream).

The model is the tiny random Llama with a word-level tokenizer and a chat template
(test_model_files.word_tokenizer). Token ids are compared through the server's
`return_token_ids` extension, so a greedy request must give exactly LLM.generate's ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import LLM, SamplingParams
from launch.openai.protocol import sse_event
from tests.helpers.cli_helpers import (
    CPU,
    ENV,
    StderrWatch,
    all_gone,
    children_of,
    processes_mentioning,
)
from tests.helpers.model_files import CONVERSATION, FANCY

MODEL_NAME = "tiny"
PROMPT_TEXT = "What is 2 + 2 ? And 3"
PROMPT_IDS = [11, 12, 13, 14, 15, 16]
N = 10
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@dataclass
class Server:
    proc: subprocess.Popen[str]
    watch: StderrWatch
    url: str
    tmp: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def start_server(model: Path | None, tmp: Path, *flags: str) -> Server:
    """`pagedserve serve` on a free port; its socket folders under tmp (orphan checks)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "0", "--device", CPU]
    if model is not None:
        cmd += ["--model", str(model), "--served-model-name", MODEL_NAME]
    proc = subprocess.Popen(
        [*cmd, *flags],
        env={**ENV, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    watch = StderrWatch(proc)
    url = watch.wait_for(r"on (https?://\S+)").group(1)
    return Server(proc, watch, url, tmp)


def nothing_left(server: Server, children: list[int]) -> None:
    assert all_gone(children + processes_mentioning(str(server.tmp))), "orphan processes"
    assert not os.listdir(server.tmp), "socket folder left behind"


def post(url: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus-client, by name and labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def wait_for_metric(url: str, name: str, want: float, timeout: float = 300) -> None:
    """Poll /metrics until name == want (the timeout only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while (got := metrics(url).get(name)) != want:
        assert time.monotonic() < deadline, f"{name} stayed {got}, never {want}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> dict[str, list[int]]:
    """LLM.generate's greedy token ids for each prompt the tests send."""
    with LLM(str(chat_model), device=CPU) as llm:
        text, ids = llm.generate([PROMPT_TEXT, PROMPT_IDS], GREEDY, use_tqdm=False)
        (chat,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    return {"text": text.token_ids, "ids": ids.token_ids, "chat": chat.token_ids}


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(chat_model, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture
def builtin_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Starts a server on the built-in model (4096 positions: long requests) with flags;
    whatever a failing test left running is stopped."""
    started: list[Server] = []

    def start(*flags: str) -> Server:
        started.append(start_server(None, tmp_path / f"server{len(started)}", *flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_completions_and_chat_equal_llm_generate(
    server: Server, client: openai.OpenAI, reference: dict[str, list[int]]
) -> None:
    args = dict(model=MODEL_NAME, max_tokens=N, temperature=0, extra_body=EXTRA)
    c = client.completions.create(prompt=PROMPT_TEXT, **args)
    assert c.choices[0].token_ids == reference["text"]  # type: ignore[attr-defined]
    assert c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.completion_tokens == N
    assert c.usage.prompt_tokens == len(c.prompt_token_ids)  # type: ignore[attr-defined]
    # Token-id prompt, streamed: the chunks' ids and texts add up to the whole answer.
    chunks = list(client.completions.create(prompt=PROMPT_IDS, stream=True, **args))
    ids = [t for ch in chunks for t in ch.choices[0].token_ids]  # type: ignore[attr-defined]
    assert ids == reference["ids"]
    whole = client.completions.create(prompt=PROMPT_IDS, **args)
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Chat, the model's template, plain and streamed with usage.
    chat_args = dict(model=MODEL_NAME, messages=CONVERSATION, temperature=0, extra_body=EXTRA)
    r = client.chat.completions.create(max_completion_tokens=N, **chat_args)  # type: ignore
    assert r.choices[0].token_ids == reference["chat"]  # type: ignore[attr-defined]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        max_tokens=N, stream=True, stream_options={"include_usage": True}, **chat_args
    )  # type: ignore[call-overload]
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    ids = [t for e in events[1:] if e.choices for t in e.choices[0].token_ids]  # type: ignore
    assert ids == reference["chat"]
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == (
        r.choices[0].message.content
    )
    usage = events[-1].usage
    assert events[-1].choices == [] and usage is not None
    assert usage.completion_tokens == N and usage.prompt_tokens == len(r.prompt_token_ids)  # type: ignore
    # The same conversation again: its prompt comes from the prefix cache, unless salted.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
    salted = client.chat.completions.create(
        max_tokens=N, **{**chat_args, "extra_body": {**EXTRA, "cache_salt": "tenant-b"}}
    )  # type: ignore[call-overload]
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert salted.choices[0].token_ids == reference["chat"]  # type: ignore[attr-defined]
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


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
    # Streamed with n=2: choice index = prompt * 2 + copy, usage summed at the end.
    stream = client.completions.create(
        prompt=[PROMPT_TEXT, PROMPT_IDS],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **args,  # type: ignore[arg-type]
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


async def _stream_text(client: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=N, temperature=0, stream=True, extra_body=EXTRA
    )
    return [t async for chunk in stream for t in chunk.choices[0].token_ids]  # type: ignore


async def _disconnect_mid_stream(url: str, prompt: object = PROMPT_IDS) -> None:
    """A raw HTTP client that reads two events of a long stream, then hangs up."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(
        {"prompt": prompt, "max_tokens": 240, "stream": True, "ignore_eos": True}
    ).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    events = 0
    while events < 2:
        line = await reader.readline()
        assert line, "the server closed the stream first"
        events += line.startswith(b"data: {")
    writer.close()
    await writer.wait_closed()


def test_concurrent_streams_finish_and_disconnects_free_every_block(
    server: Server, reference: dict[str, list[int]]
) -> None:
    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        jobs = [_stream_text(client, PROMPT_IDS) for _ in range(64)]
        jobs += [_disconnect_mid_stream(server.url) for _ in range(16)]  # type: ignore[misc]
        several = [PROMPT_IDS, PROMPT_TEXT, [7, 8]]  # a hang-up aborts all three
        jobs += [_disconnect_mid_stream(server.url, several) for _ in range(4)]  # type: ignore[misc]
        results = await asyncio.gather(*jobs)
        await client.close()
        return results[:64]  # type: ignore[return-value]

    assert asyncio.run(run()) == [reference["ids"]] * 64
    # Each hang-up aborted its request: once the server holds none open, one more request
    # runs a step after the aborts and reports the pool empty.
    wait_for_metric(server.url, "pagedserve:open_requests", 0)
    assert post(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})[0] == 200
    m = metrics(server.url)
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0


def test_an_event_breaks_no_line_inside_its_json() -> None:
    """Text with the characters str.splitlines ends lines at (U+0085, U+2028, U+2029):
    a client reading lines that way (httpx's iter_lines) still gets one whole event."""
    text = 'a\u2028b\x85c\u2029d\u00e9\n"}'
    event = sse_event({"text": text}).decode()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert event[:-2].splitlines() == [event[:-2]]
    assert json.loads(event[len("data: ") : -2]) == {"text": text}


BAD_BODIES = {
    "missing prompt": ({"max_tokens": 3}, "prompt", "missing_required_parameter"),
    "negative max_tokens": ({"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    "prompt too long": ({"prompt": [7] * 300}, "prompt", "context_length_exceeded"),
    "prompt + max_tokens too long": (
        {"prompt": [7] * 200, "max_tokens": 100},
        "max_tokens",
        "context_length_exceeded",
    ),
    "wrong type": ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "invalid_type"),
    "prompt of floats": ({"prompt": [1.5]}, "prompt", "invalid_type"),
    "token outside the vocabulary": ({"prompt": [10**6]}, "prompt", "invalid_value"),
    "unknown model": ({"prompt": "x", "model": "gpt-4"}, "model", "model_not_found"),
    "unknown field": ({"prompt": "x", "bogus": 1}, "bogus", "unknown_parameter"),
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


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # template refuses
        ({"messages": "hello"}, "messages"),
        ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "tools"),
    ],
    ids=["malformed JSON", "template refuses", "messages not a list", "tools"],
)
def test_a_bad_chat_body_is_a_400(server: Server, body: object, param: str | None) -> None:
    status, answer = post(f"{server.url}/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_metrics_parse_and_move(server: Server, client: openai.OpenAI) -> None:
    before = metrics(server.url)
    for _ in range(2):  # the second finds the first's prompt cached
        client.completions.create(model=MODEL_NAME, prompt=[9] * 40, max_tokens=3, temperature=0)
    after = metrics(server.url)
    moved = {
        "vllm:prompt_tokens_total": 80,
        "vllm:generation_tokens_total": 6,
        "vllm:request_success_total{finished_reason=length}": 2,
        "vllm:time_to_first_token_seconds_count": 2,
        "vllm:inter_token_latency_seconds_count": 4,
        "vllm:e2e_request_latency_seconds_count": 2,
        "vllm:request_prompt_tokens_count": 2,
        "vllm:request_generation_tokens_sum": 6,
        "vllm:prefix_cache_queries_total": 80,
        "vllm:request_queue_time_seconds_count": 2,
        "vllm:request_prefill_time_seconds_count": 2,
        "vllm:request_decode_time_seconds_count": 2,
        "vllm:request_inference_time_seconds_count": 2,
        "vllm:request_time_per_output_token_seconds_count": 2,
        "vllm:request_max_num_generation_tokens_sum": 6,
        "vllm:request_params_n_sum": 2,
        "vllm:request_params_max_tokens_sum": 6,
        "vllm:prompt_tokens_cached_total": 32,  # the second's two full blocks
    }
    for name, delta in moved.items():
        assert after[name] - before.get(name, 0) == delta, name
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 32

    def spent(name: str) -> float:
        return after[f"{name}_sum"] - before.get(f"{name}_sum", 0)

    # The engine's share of each request's time: queue + inference = the whole.
    queue, inference = (
        spent("vllm:request_queue_time_seconds"),
        spent("vllm:request_inference_time_seconds"),
    )
    assert 0 <= queue <= spent("vllm:e2e_request_latency_seconds")
    assert queue + inference == pytest.approx(spent("vllm:e2e_request_latency_seconds"))
    for name in ("vllm:num_preemptions_total", "vllm:num_requests_waiting"):
        assert name in after


def test_health_and_reset_prefix_cache(server: Server) -> None:
    with urllib.request.urlopen(f"{server.url}/health", timeout=60) as r:
        assert r.status == 200
    body = {"prompt": [8] * 40, "max_tokens": 1}
    post(f"{server.url}/v1/completions", body)
    assert post(f"{server.url}/reset_prefix_cache", b"")[0] == 200
    status, answer = post(f"{server.url}/v1/completions", body)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


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
        ("tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("detokenize", {"tokens": "abc"}, "tokens"),
    ):
        status, answer = post(f"{server.url}/{url}", body)
        assert status == 400 and answer["error"]["param"] == param, (url, body, answer)
    with urllib.request.urlopen(f"{server.url}/version", timeout=60) as v:
        assert json.loads(v.read())["version"]


def test_an_api_key_guards_every_route_but_the_probes_and_stats_are_logged(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server("--api-key", "s3cret", "--log-stats-interval", "0.2")
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0)
    args = dict(prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.completions.create(model="pagedserve-builtin", **args)  # type: ignore[call-overload]
    assert refused.value.code == "invalid_api_key" and refused.value.status_code == 401
    chunks = list(good.completions.create(model="pagedserve-builtin", stream=True, **args))  # type: ignore
    assert chunks[-1].choices[0].finish_reason == "length"
    for path in ("/v1/completions", "/tokenize", "/reset_prefix_cache"):
        status, answer = post(server.url + path, {"prompt": "x"})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", path
    for path in ("/health", "/metrics", "/version"):
        with urllib.request.urlopen(server.url + path, timeout=60) as r:
            assert r.status == 200, path
    # vLLM's periodic line, at the default log level: the interval that held the stream's
    # tokens reports them (waited for, not timed).
    line = server.watch.wait_for(r"pagedserve.stats: Avg prompt throughput: .*").group(0)
    assert "Running:" in line and "KV cache usage:" in line
    server.watch.wait_for(r"Avg generation throughput: [1-9]")


TLS = (
    Path(__file__).resolve().parents[2] / "data"
)  # a self-signed certificate for 127.0.0.1, to 2126


def _fetch(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str]]:
    """Status and headers of a request over TLS, trusting only the test certificate."""
    context = ssl.create_default_context(cafile=str(TLS / "tls_cert.pem"))
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def test_https_cors_and_a_root_path(builtin_server: Callable[..., Server]) -> None:
    """Served over TLS behind a path prefix, with CORS for one origin and an API key: the
    probes stay open, a browser's preflight needs no key, other origins get no CORS."""
    ui = "http://ui.example"
    server = builtin_server(
        *("--ssl-keyfile", str(TLS / "tls_key.pem"), "--ssl-certfile", str(TLS / "tls_cert.pem")),
        *("--allowed-origins", f'["{ui}"]', "--api-key", "secret", "--root-path", "/api"),
        *("--served-model-name", "main", "alias"),
    )
    assert server.url.startswith("https://127.0.0.1:")
    assert _fetch(f"{server.url}/health")[0] == 200
    assert _fetch(f"{server.url}/ping")[0] == _fetch(f"{server.url}/ping", "POST")[0] == 200
    status, headers = _fetch(
        f"{server.url}/v1/models",
        "OPTIONS",
        Origin=ui,
        **{
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert status == 200 and headers["access-control-allow-origin"] == ui
    status, headers = _fetch(f"{server.url}/v1/models", Origin=ui, Authorization="Bearer secret")
    assert status == 200 and headers["access-control-allow-origin"] == ui
    status, headers = _fetch(f"{server.url}/v1/models", Origin="http://evil.example")
    assert status == 401 and "access-control-allow-origin" not in headers
    import httpx2

    http = httpx2.Client(verify=ssl.create_default_context(cafile=str(TLS / "tls_cert.pem")))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", http_client=http)
    # Two names: both listed and served, answers carry the first.
    assert [m.id for m in client.models.list()] == ["main", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    answer = client.completions.create(model="alias", prompt="x", max_tokens=1)
    assert answer.model == "main"
    with pytest.raises(openai.BadRequestError, match="'main' or 'alias'"):
        client.completions.create(model="other", prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--ssl-keyfile", str(TLS / "tls_key.pem")), "go together"),
        (("--ssl-keyfile", "/nope", "--ssl-certfile", "/nope"), "no such file"),
        (
            (
                "--ssl-keyfile",
                str(TLS / "tls_cert.pem"),
                "--ssl-certfile",
                str(TLS / "tls_cert.pem"),
            ),
            "--ssl-certfile / --ssl-keyfile",
        ),
        (("--ssl-cert-reqs", "2"), "need --ssl-keyfile"),
        (("--allowed-origins", "[1]"), "JSON list"),
    ],
)
def test_bad_tls_and_cors_flags_stop_before_the_engine_starts(
    flags: tuple[str, ...], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--port", "0", *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def _sse_stream(url: str, body: dict) -> subprocess.Popen[bytes]:
    """A long streaming request from another process (curl-like), so the test can act
    while it runs; its stdout is the raw event stream."""
    code = (
        "import sys, urllib.request\n"
        f"r = urllib.request.Request({url + '/v1/completions'!r}, {json.dumps(body).encode()!r},"
        " {'Content-Type': 'application/json'})\n"
        "with urllib.request.urlopen(r, timeout=600) as f:\n"
        "    for line in f:\n"
        "        sys.stdout.buffer.write(line); sys.stdout.flush()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def _first_event(stream: subprocess.Popen[bytes]) -> None:
    assert stream.stdout is not None
    while not stream.stdout.readline().startswith(b"data: {"):
        pass


def test_back_pressure_then_a_killed_worker_ends_streams_and_the_server(
    builtin_server: Callable[..., Server],
) -> None:
    # One request runs at a time; one more may wait; a third is refused with 503.
    server = builtin_server("--max-num-seqs", "1", "--max-waiting-requests", "1")
    children = children_of(server.proc.pid)
    long = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    running = _sse_stream(server.url, long)
    _first_event(running)
    waiting = _sse_stream(server.url, long)
    wait_for_metric(server.url, "vllm:num_requests_waiting", 1)
    status, answer = post(f"{server.url}/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 503 and "--max-waiting-requests 1" in answer["error"]["message"]
    (worker,) = [p for p in children if b"worker.main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(worker, signal.SIGKILL)
    for stream in (running, waiting):
        out, _ = stream.communicate(timeout=300)
        events = [line for line in out.splitlines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert "worker rank 0" in error["message"], error
    assert server.proc.wait(timeout=60) == 1
    stderr = server.watch.join()
    assert "worker rank 0" in stderr and "Traceback" not in stderr, stderr
    nothing_left(server, children)


def _leave_a_plain_request(url: str) -> None:
    """Send a long request that is not streamed; hang up once the server has it open."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "b", "max_tokens": 4000, "ignore_eos": True})
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for_metric(url, "pagedserve:open_requests", 2)


def test_sigterm_ends_open_streams_and_stops_everything(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server()
    children = children_of(server.proc.pid)
    stream = _sse_stream(
        server.url, {"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    )
    _first_event(stream)
    # A client that leaves a plain (not streamed) request aborts it too: only the
    # stream stays open (the request would otherwise run its 4000 tokens).
    _leave_a_plain_request(server.url)
    wait_for_metric(server.url, "pagedserve:open_requests", 1)
    server.proc.send_signal(signal.SIGTERM)
    out, _ = stream.communicate(timeout=300)
    events = [line for line in out.splitlines() if line]
    assert events[-1] == b"data: [DONE]"  # the stream was ended, not cut
    assert b"the server is stopping" in events[-2]
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.watch.join()
    nothing_left(server, children)


def test_a_shutdown_timeout_lets_open_streams_finish(
    builtin_server: Callable[..., Server],
) -> None:
    """With --shutdown-timeout, SIGTERM stops taking requests (503, /health 503) while
    the open stream runs to its end; then the server exits 0 and leaves nothing."""
    server = builtin_server("--shutdown-timeout", "600")
    children = children_of(server.proc.pid)
    # Long enough (seconds) to be open while the test sees the server drain.
    stream = _sse_stream(
        server.url, {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    )
    _first_event(stream)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 300
    while (status := _status(f"{server.url}/health")) == 200:
        assert time.monotonic() < deadline, "never started draining"
        time.sleep(0.05)
    assert status == 503
    status, answer = post(f"{server.url}/v1/completions", {"prompt": "b", "max_tokens": 2})
    assert status == 503 and answer["error"]["code"] == "server_shutting_down", answer
    out, _ = stream.communicate(timeout=600)
    events = [line for line in out.splitlines() if line]
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length", last  # ran to its end
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.watch.join()
    nothing_left(server, children)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


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


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_through_the_openai_client(
    builtin_server: Callable[..., Server],
) -> None:
    """response_format (OpenAI's) and structured_outputs (vLLM's), streamed and not, on
    the built-in model (byte tokenizer: the text is exactly what the language allows)."""
    server = builtin_server("--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = client.chat.completions.create(
        model="pagedserve-builtin",
        messages=[{"role": "user", "content": "A person: "}],
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=400,  # whitespace between JSON tokens is bounded: so is the answer
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice
    person = json.loads(choice.message.content or "")
    assert set(person) == {"name", "ok"} and len(person["name"]) <= 5
    assert isinstance(person["ok"], bool)
    any_object = client.chat.completions.create(
        model="pagedserve-builtin",
        messages=[{"role": "user", "content": "JSON: "}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    ).choices[0]
    if any_object.finish_reason == "stop":  # else cut at max_tokens, inside the object
        assert isinstance(json.loads(any_object.message.content or ""), dict)
    assert (any_object.message.content or "").lstrip().startswith("{")
    # Streamed, a choice and a regex, several seeded samples each.
    for extra, check in (
        ({"choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        ({"regex": "[0-9]{3}-[a-f]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-f]{2}", t)),
    ):
        stream = client.completions.create(
            model="pagedserve-builtin",
            prompt="Go ",
            max_tokens=20,
            temperature=1.0,
            seed=3,
            n=4,
            stream=True,
            extra_body={"structured_outputs": extra},
        )
        texts = ["", "", "", ""]
        finishes: list[str | None] = [None] * 4
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
        assert finishes == ["stop"] * 4 and all(check(t) for t in texts), texts
    # Bad specs are 400s naming their field; the server keeps serving.
    for body, param in (
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 1}, "min_tokens"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ):
        status, answer = post(f"{server.url}/v1/completions", {"prompt": "x", **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = post(
        f"{server.url}/v1/completions",
        {"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["ok"]}},
    )
    assert status == 200 and answer["choices"][0]["text"] == "ok", answer


# A template that shows what it got: the tools' names, and each call's arguments as the
# object templates expect (transformers' convention).
TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>"
    "{% endfor %}{% endif %}\n{% endfor %}"
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
ASK = [{"role": "user", "content": "Weather?"}]
# ASK, a call of "now" and its result.
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"z": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "noon"},
]


def _streamed_calls(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, calls by index with id, name and arguments, finish reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            got = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += call.id or ""
            got["name"] += (call.function and call.function.name) or ""
            got["arguments"] += (call.function and call.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_calls_through_the_openai_client(builtin_server: Callable[..., Server]) -> None:
    """tool_choice named, required and auto (Hermes blocks, with the parser), streamed and
    not; the tools and earlier calls reach the chat template."""
    server = builtin_server("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", "hermes")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(model="pagedserve-builtin", tools=TOOLS, temperature=0)
    # The template got the tools, and a call's arguments as an object.
    status, tokens = post(f"{server.url}/tokenize", {"messages": CALLED, "tools": TOOLS})
    want = '[get_weather][now]user:Weather?assistant:None<now {"z": 1}>tool:noon'  # trim_blocks
    assert status == 200 and bytes(tokens["tokens"]).decode() == want, tokens
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(messages=ASK, tool_choice=named, max_tokens=300, **args)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    city = json.loads(call.function.arguments)["city"]
    assert isinstance(city, str) and len(city) <= 6
    stream = client.chat.completions.create(
        messages=ASK, tool_choice=named, max_tokens=300, stream=True, **args
    )
    content, calls, finish = _streamed_calls(list(stream))
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # greedy
    for stream_it in (False, True):
        got = client.chat.completions.create(
            messages=ASK,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=600,
            stream=stream_it,
            **args,
        )
        if stream_it:
            content, calls, finish = _streamed_calls(list(got))  # type: ignore[arg-type]
            names = [c["name"] for c in calls.values()]
            arguments = [c["arguments"] for c in calls.values()]
        else:
            message = got.choices[0].message  # type: ignore[union-attr]
            finish, content = got.choices[0].finish_reason, message.content  # type: ignore[union-attr]
            names = [c.function.name for c in message.tool_calls or []]
            arguments = [c.function.arguments for c in message.tool_calls or []]
        assert finish == "tool_calls" and not content and len(names) == 1, got
        assert names[0] in ("get_weather", "now") and isinstance(json.loads(arguments[0]), dict)
    # auto: the model's own Hermes blocks (forced here: a random model writes none).
    forced = 'On it.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    extra = {"structured_outputs": {"regex": re.escape(forced)}}
    message = (
        client.chat.completions.create(messages=ASK, max_tokens=100, extra_body=extra, **args)
        .choices[0]
        .message
    )
    assert message.content == "On it." and [c.function.name for c in message.tool_calls or []] == [
        "now"
    ]
    stream = client.chat.completions.create(
        messages=ASK, max_tokens=100, extra_body=extra, stream=True, **args
    )
    chunks = list(stream)
    content, calls, finish = _streamed_calls(chunks)
    assert content == "On it." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("now", {})]
    # The text went out as it came, up to where the call began.
    assert sum(bool(c.choices[0].delta.content) for c in chunks) >= 2
    for body, param in (
        ({"tool_choice": named, "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "other"}]}, "tools"),
    ):
        status, answer = post(
            f"{server.url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS, **body}
        )
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


@pytest.mark.parametrize(
    ("parser", "written"),
    [
        ("pythonic", '[get_weather(city="Oslo"), now()]'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now"}'),
    ],
)
def test_whole_answer_tool_formats(
    builtin_server: Callable[..., Server], parser: str, written: str
) -> None:
    """Formats whose calls are the whole answer: a stream holds the answer while it may be
    a call, and lets a plain one go as it comes."""
    server = builtin_server("--chat-template", TOOLS_TEMPLATE, "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    args: dict[str, Any] = dict(
        model="pagedserve-builtin", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200
    )
    want = [("get_weather", {"city": "Oslo"}), ("now", {})]
    extra = {"structured_outputs": {"regex": re.escape(written)}}
    choice = client.chat.completions.create(extra_body=extra, **args).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    chunks = list(client.chat.completions.create(extra_body=extra, stream=True, **args))
    content, streamed, finish = _streamed_calls(chunks)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == want
    plain = {"structured_outputs": {"regex": re.escape("Sure, it is sunny in Oslo today.")}}
    chunks = list(client.chat.completions.create(extra_body=plain, stream=True, **args))
    content, streamed, finish = _streamed_calls(chunks)
    assert content == "Sure, it is sunny in Oslo today." and not streamed and finish == "stop"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) >= 2  # not held to the end


def test_auto_tool_choice_needs_a_parser(server: Server) -> None:
    status, answer = post(f"{server.url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
    assert status == 400 and answer["error"]["param"] == "tool_choice", answer
    assert "--tool-call-parser" in answer["error"]["message"]
    status, answer = post(
        f"{server.url}/v1/chat/completions",
        {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
    )
    assert status == 200 and "tool_calls" not in answer["choices"][0]["message"], answer
