"""serve_vs_vllm's processes: `vllm serve` from the peer venv, vLLM's `bench serve` client
run against either server, and what both servers' process trees use (CPU time, the CPUs
each thread may run on, preemptions from /metrics)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from serve_bench_server import children, cpu_seconds, http_get


def log(msg: str) -> None:
    print(f"[serve_vs_vllm] {msg}", file=sys.stderr, flush=True)


# The figures read from a `bench serve` result file, under our names.
BENCH_KEYS = {
    "output_tok_s": "output_throughput",
    "request_s": "request_throughput",
    "duration_s": "duration",
    "completed": "completed",
    "failed": "failed",
    "input_tokens": "total_input_tokens",
    "output_tokens": "total_output_tokens",
}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerServer:
    """`vllm serve MODEL` (serve.py in the peer's scripts) on a free port, its CPU KV space
    set, in its own process group; its output kept for the placement it logs."""

    def __init__(
        self, python: Path, script: Path, model: Path, kv_gib: int, extra: list[str]
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(python), str(script), "serve", str(model), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *extra]
        env = dict(
            os.environ,
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        # The peer venv's own packages only: ours on PYTHONPATH would shadow them.
        env.pop("PYTHONPATH", None)
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5) as r,
            ):
                if r.status == 200:
                    return self.url
            time.sleep(0.5)
        raise RuntimeError(
            f"vllm serve not ready (exit {self.proc.poll()}):\n" + "".join(self.lines[-40:])
        )

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("vllm serve did not stop in 30 s: killing its process group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def bench_serve(
    python: Path,
    script: Path,
    url: str,
    served: str,
    model: Path,
    dataset: list[str],
    concurrency: int,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """One run of vLLM's `bench serve` against url (dataset: its backend, endpoint and
    dataset flags): its result file's figures."""
    cmd = [str(python), str(script), "bench", "serve", "--base-url", url, "--model", served]
    cmd += ["--tokenizer", str(model), *dataset, "--max-concurrency", str(concurrency)]
    cmd += ["--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm"]
    cmd += ["--percentile-metrics", ",".join(PERCENTILE_METRICS), "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    out.unlink(missing_ok=True)  # a kept directory may hold an earlier run's file
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n{tail}")
    res = json.loads(out.read_text())
    got: dict[str, Any] = {k: res.get(v) for k, v in BENCH_KEYS.items()}
    for m in PERCENTILE_METRICS:
        for p in ("50", "99"):
            v = res.get(f"p{p}_{m}_ms")
            got[f"{m}_p{p}_ms"] = round(v, 3) if v is not None else None
    got["output_tok_s"] = round(got["output_tok_s"], 2)
    got["request_s"] = round(got["request_s"], 4)
    got["duration_s"] = round(got["duration_s"], 3)
    if got["failed"]:
        # The result file keeps no per-request errors unless detailed; the client prints them.
        got["errors"] = [x for x in proc.stdout.splitlines() if x.startswith("Error ")][:3]
    if not got["completed"]:
        # Latencies of a run with no request are zeros, not figures to summarize.
        raise RuntimeError(f"no request completed: {got.get('errors')}")
    return got


def served_model(url: str) -> str:
    """The model id a server answers to (its /v1/models)."""
    return str(json.loads(http_get(f"{url}/v1/models"))["data"][0]["id"])


def tree(pid: int) -> list[int]:
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def tree_cpu(pids: list[int]) -> float:
    return sum(t for t in (cpu_seconds(p) for p in pids) if t is not None)


def _status(path: Path) -> dict[str, str]:
    fields = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return fields


def placement(pid: int) -> list[dict[str, Any]]:
    """Each process of a server: its name, thread count, and how many of its threads may
    run on which CPUs (a pinned compute thread shows as its own CPU list)."""
    procs = []
    for p in tree(pid):
        argv: list[bytes] = []
        st = _status(Path(f"/proc/{p}/status"))
        if not st:
            continue
        lists: Counter[str] = Counter()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                cpus = _status(Path(f"/proc/{p}/task/{task}/status")).get("Cpus_allowed_list")
                if cpus is not None:
                    lists[cpus] += 1
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        procs.append(
            {
                "pid": p,
                "name": st.get("Name"),
                "cmd": b" ".join(argv).decode(errors="replace")[:160],
                "threads": int(st.get("Threads", "0")),
                "threads_by_cpus": dict(lists),
            }
        )
    return procs


def preemptions(url: str) -> float | None:
    """The server's preemption counter (both servers export vllm:num_preemptions)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http_get(f"{url}/metrics").decode()
    except OSError:
        return None
    total = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:num_preemptions_total":
                total = (total or 0.0) + s.value
    return total
