"""The OpenAI server as a real Ray Serve application on this machine: the built-in model
behind two engine replicas, answered over HTTP by Serve's proxy (plain and streamed) with
the tokens LLM gives; requests sharing a prefix routed to the replica that caches it; and
nothing left once Serve shuts down."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
from ray import serve

from launch.client.llm import LLM
from launch.ray_serve import build_app
from tests.helpers.cli_helpers import CPU, all_gone, children_of, processes_mentioning
from tests.helpers.ray_cluster import checkout_importable
from tests.helpers.server import EXTRA, GREEDY, MODEL_NAME, PROMPT_IDS, PROMPT_TEXT, N

APP = "pagedserve"
ENGINE_ARGS = {"device": CPU, "max_model_len": 256, "num_gpu_blocks": 96}


@dataclass
class ServeApp:
    url: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app() -> Iterator[ServeApp]:
    """A local Ray (its actors import this checkout) with the application deployed: two
    engine replicas, one ingress."""
    port = _free_port()
    with checkout_importable():
        yield from _deployed(port)


def _deployed(port: int) -> Iterator[ServeApp]:
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            **ENGINE_ARGS,
            "served_model_name": MODEL_NAME,
            "num_replicas": 2,
            "health_check_period_s": 1,  # a replica whose engine died is replaced soon
        }
        serve.run(build_app(args), name=APP, route_prefix="/")
        yield ServeApp(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return r.status, r.read()


def _complete(app: ServeApp, prompt: object, **fields: object) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": N, "temperature": 0}
    status, data = _post(f"{app.url}/v1/completions", {**body, **EXTRA, **fields})
    assert status == 200
    return json.loads(data)


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """What LLM generates for the same greedy requests, on the same engine settings."""
    with LLM(None, **ENGINE_ARGS) as llm:
        by_ids, by_text = llm.generate([PROMPT_IDS, PROMPT_TEXT], GREEDY, use_tqdm=False)
    return {"ids": by_ids.token_ids, "text": by_text.token_ids}


def test_models_lists_the_served_name(app: ServeApp) -> None:
    with urllib.request.urlopen(f"{app.url}/v1/models", timeout=60) as r:
        cards = json.loads(r.read())["data"]
    assert [c["id"] for c in cards] == [MODEL_NAME]


def test_completions_give_the_tokens_llm_gives(app: ServeApp, expected: dict) -> None:
    for prompt, key in ((PROMPT_IDS, "ids"), (PROMPT_TEXT, "text")):
        choice = _complete(app, prompt)["choices"][0]
        assert choice["token_ids"] == expected[key]
        assert choice["finish_reason"] == "length"


def test_a_stream_arrives_as_server_sent_events_with_the_same_text(app: ServeApp) -> None:
    whole = _complete(app, PROMPT_IDS)["choices"][0]["text"]
    status, data = _post(
        f"{app.url}/v1/completions",
        {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": N, "temperature": 0,
         "ignore_eos": True, "stream": True},
    )  # fmt: skip
    assert status == 200
    events = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == whole
    assert chunks[-1]["finish_reason"] == "length"


def test_a_bad_request_fails_alone(app: ServeApp) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        _complete(app, PROMPT_IDS, max_tokens=-1)
    assert e.value.code == 400 and "max_tokens" in e.value.read().decode()
    assert _complete(app, PROMPT_IDS)["choices"][0]["finish_reason"] == "length"


def test_requests_sharing_a_prefix_go_to_the_replica_that_caches_it(app: ServeApp) -> None:
    """A fresh four-block prefix (token ids or text), sent twice: the second request lands
    where the first left it cached and reads all of it from cache. (Routed by load, it would land on
    either replica: eight fresh prefixes all found by chance is 1 in 256.)"""

    def second_request_hits(k: int) -> bool:
        """Odd k: a text prompt, which the ingress tokenizes as the engines do."""
        ids = [(7 * i + 13 * k) % 300 + 10 for i in range(64)]
        text = "".join(chr(ord("a") + (3 * i + k) % 26) for i in range(70))
        for suffix in (1, 2):
            prompt = f"{text} {suffix}" if k % 2 else [*ids, suffix, suffix + 1]
            body = _complete(app, prompt, max_tokens=2)
        return body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # 4 blocks

    # Replicas tell the router where their events are in their periodic stats (every
    # 2 s); until then requests go by load. Wait for three hits in a row, generously.
    streak = 0
    for k in range(60):
        streak = streak + 1 if second_request_hits(k) else 0
        if streak == 3:
            break
    else:
        pytest.fail("the router never found a prefix cached")
    assert [second_request_hits(100 + k) for k in range(8)] == [True] * 8


def _tree(pid: int) -> list[int]:
    return [pid, *(p for child in children_of(pid) for p in _tree(child))]


def _engine_replicas() -> list[int]:
    return processes_mentioning(f"ServeReplica:{APP}:PagedServeEngine")


def test_a_replica_whose_engine_dies_is_replaced_and_the_other_keeps_serving(
    app: ServeApp,
) -> None:
    before = _engine_replicas()
    assert len(before) == 2
    (core,) = [p for p in _tree(before[0]) if b"enginecore.core" in _cmdline(p)]
    os.kill(core, signal.SIGKILL)
    # Until Serve's health check replaces it, a request routed to the dead engine fails
    # alone with 503 naming why; the other replica answers.
    failures: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            _complete(app, PROMPT_IDS)
        except urllib.error.HTTPError as e:
            assert e.code == 503
            failures.append(e.read().decode())
        after = _engine_replicas()
        if before[0] not in after and len(after) == 2:
            break
    else:
        pytest.fail("Serve did not replace the replica whose engine died")
    assert all("engine" in f for f in failures), failures
    for _ in range(6):
        assert _complete(app, PROMPT_IDS)["choices"][0]["finish_reason"] == "length"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _engines_started(replica: int) -> bool:
    lines = [_cmdline(p) for p in _tree(replica)]
    return any(b"enginecore.core" in c for c in lines) and any(b"worker.main" in c for c in lines)


def test_shutdown_leaves_no_actor_or_process(app: ServeApp) -> None:
    # A replica Serve just replaced (the test before) may still be starting its engine.
    deadline = time.monotonic() + 120
    while not ((replicas := _engine_replicas()) and all(map(_engines_started, replicas))):
        assert time.monotonic() < deadline, "a replica never started its engine"
        time.sleep(0.2)
    assert len(replicas) == 2
    engines = [p for r in replicas for p in _tree(r)]
    assert len(engines) >= 2 * 3, "each replica runs an engine core and a worker"
    serve.shutdown()
    assert all_gone(engines), "an engine process outlived Serve's shutdown"
    assert not ray.util.list_named_actors(all_namespaces=True)
