"""`pagedserve serve --data-parallel-size 2`: one server over two replicas; /metrics labels
each replica's series with its index and counts the router's decisions; /health stays
200 while a replica restarts; the restarted replica takes requests again; a stop leaves
no process or socket folder behind. run-batch takes the flag too; generate refuses it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cli_helpers import ENV, children_of, generate_cli
from tests.helpers.server import Server, nothing_left, post


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every /metrics sample by name and labels (the model name left out)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _engine(url: str, name: str, engine: str) -> float:
    return _samples(url)[(name, (("engine", engine), ("source", "local_compute")))]


def _health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=60) as r:
        return r.status


def _complete(url: str, prompt: list[int]) -> None:
    status, body = post(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200, body


def test_two_replicas_behind_one_server_survive_a_killed_core(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server("--data-parallel-size", "2", "--log-level", "info")
    children = children_of(server.proc.pid)
    cores = [p for p in children if b"enginecore.core" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(cores) == 2
    for i in range(4):  # distinct prompts, one at a time: the replicas take turns
        _complete(server.url, [i + 1] * 20)
    samples = _samples(server.url)
    decisions = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "pagedserve:router_requests_total"
    }
    assert decisions == {"prefix_hit": 0.0, "tie": 0.0, "load": 4.0}
    assert samples[("pagedserve:router_load_skips_total", ())] == 0
    computed = [_engine(server.url, "vllm:prompt_tokens_by_source_total", e) for e in "01"]
    assert computed == [40, 40]
    assert {
        dict(labels)["engine"] for (name, labels) in samples if name == "vllm:cache_config_info"
    } == {"0", "1"}

    os.kill(cores[0], signal.SIGKILL)
    victim = server.watch.wait_for(r"data-parallel replica (\d) stopped").group(1)
    assert _health(server.url) == 200  # the other replica serves
    _complete(server.url, [9] * 20)
    server.watch.wait_for(rf"data-parallel replica {victim} serves again")
    assert _health(server.url) == 200
    before = _engine(server.url, "vllm:prompt_tokens_by_source_total", victim)
    for i in range(2):
        _complete(server.url, [i + 20] * 20)
    assert _engine(server.url, "vllm:prompt_tokens_by_source_total", victim) == before + 20
    children = children + children_of(server.proc.pid)
    server.stop()
    assert server.proc.returncode == 0
    nothing_left(server, children)


def test_generate_refuses_data_parallel_and_names_the_commands_that_take_it(
    tmp_path: Path,
) -> None:
    proc, results = generate_cli(None, ['{"prompt": "hi"}'], tmp_path, "--data-parallel-size", "2")
    assert proc.returncode == 1 and not results
    assert "serve and run-batch take --data-parallel-size" in proc.stderr, proc.stderr


def test_run_batch_over_two_replicas_answers_every_line(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "pagedserve-builtin", "max_tokens": 3, "ignore_eos": True}
    lines = [
        {"custom_id": str(i), "method": "POST", "url": "/v1/completions",
         "body": {**body, "prompt": [i + 1] * 4}}
        for i in range(4)
    ]  # fmt: skip
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "launch.cli", "run-batch", "-i", str(inp), "-o", str(out)]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--dp", "2", "--no-progress"],
        capture_output=True, text=True, env=ENV, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["0", "1", "2", "3"]
    assert all(a["response"]["status_code"] == 200 for a in answers), answers
