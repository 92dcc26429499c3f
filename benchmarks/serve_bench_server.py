"""The server serve_bench drives: `pagedserve serve` started and stopped here, its /metrics
counters, and the CPU time of its processes read from /proc."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVER_LINE = re.compile(r"on (https?://\S+)")


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


class ServerProcess:
    """`pagedserve serve` on a free port, in its own process group so the terminal's
    Ctrl-C reaches only us, and we stop it in order (SIGTERM, then SIGKILL)."""

    def __init__(
        self, a: argparse.Namespace, prefix_caching: bool, extra: tuple[str, ...] = ()
    ) -> None:
        # INFO: the CPU worker logs its thread-count choices (reported per run); nothing
        # is logged per step or per request at that level.
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "0", "--log-level", "INFO"]
        if a.profile_server:
            # cProfile writes its file when serve returns (SIGTERM ends it with status 0).
            out = f"{a.profile_server}.{'on' if prefix_caching else 'off'}.prof"
            cmd[1:1] = ["-m", "cProfile", "-o", out]
        cmd += _engine_flags(a, prefix_caching)
        cmd += ["--stream-interval", str(a.stream_interval)]
        if a.model is not None:
            cmd += ["--model", a.model]
        cmd += extra
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._url: str | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = SERVER_LINE.search(line)
            if m and self._url is None:
                self._url = m.group(1)
                self._seen.set()
        self._seen.set()

    def wait_ready(self, timeout: float) -> str:
        self._seen.wait(timeout)
        if self._url is None:
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self._url}/health", timeout=5) as r,
            ):
                if r.status == 200:
                    return self._url
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("/health never answered 200:\n" + "".join(self.lines[-30:]))
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM (the server stops its engine in order), SIGKILL for the group if that
        takes too long; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("the server did not stop in 30 s: killing its process group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _engine_flags(a: argparse.Namespace, prefix_caching: bool) -> list[str]:
    flags = []
    if a.device:
        flags += ["--device", a.device]
    if a.dtype:
        flags += ["--dtype", a.dtype]
    if not prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def engine_kwargs(a: argparse.Namespace, prefix_caching: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"enable_prefix_caching": prefix_caching}
    if a.device:
        kw["device"] = a.device
    if a.dtype:
        kw["dtype"] = a.dtype
    return kw


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def server_counters(url: str) -> dict[str, float]:
    """The server's /metrics counters this benchmark reads: prefix-cache queries and
    hits in tokens, and TTFT as the server measures it (from a request's arrival)."""
    from prometheus_client.parser import text_string_to_metric_families

    got = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(http_get(f"{url}/metrics").decode()):
        for s in family.samples:
            if s.name in got:
                got[s.name] += s.value
    return got


def reset_server_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) a process has used so far; None without one."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Pids of pid's direct children (a server's engine processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    out.append(int(entry))
    return out


def total_cpu(pids: list[int]) -> float | None:
    times = [cpu_seconds(p) for p in pids]
    return sum(t for t in times if t is not None) if pids else None
