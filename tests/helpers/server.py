"""`pagedserve serve` as tests start and query it: a server on a free port (its socket
folders under a test's tmp, for orphan checks), JSON posts, /metrics parsed, and the
model name, prompts and tool-calling data the server tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from launch import SamplingParams
from tests.helpers.cli_helpers import (
    CPU,
    ENV,
    StderrWatch,
    all_gone,
    processes_mentioning,
)

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
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def wait_for_metric(url: str, name: str, want: float, timeout: float = 300) -> None:
    """Poll /metrics until name == want (the timeout only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while (got := metrics(url).get(name)) != want:
        assert time.monotonic() < deadline, f"{name} stayed {got}, never {want}"
        time.sleep(0.05)


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
