"""The edges of `pagedserve serve`'s and `run-batch`'s life: a second stop signal while the
first one's shutdown runs, the launcher killed outright during that shutdown, and /health
once the engine is dead. Real processes on the built-in model; each case asserts the exit
status, no "Traceback", no process of the group alive and no socket folder left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import (
    CPU,
    ENV,
    StderrWatch,
    all_gone,
    children_of,
    reap,
)
from tests.helpers.server import Server, nothing_left, start_server

LONG = {"model": "pagedserve-builtin", "prompt": "ab", "max_tokens": 4000, "ignore_eos": True}
SHORT = {"model": "pagedserve-builtin", "prompt": "ab", "max_tokens": 1}


def _child(proc: subprocess.Popen[str], module: str) -> int:
    (pid,) = [p for p in children_of(proc.pid) if module in Path(f"/proc/{p}/cmdline").read_text()]
    return pid


def _call(url: str, body: object | None = None) -> tuple[int, str]:
    """(status, body) of a GET, or of a POST of body as JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _open_stream(server: Server) -> threading.Thread:
    """A long streamed completion, running once this returns (its first chunk came)."""
    started = threading.Event()

    def read() -> None:
        body = json.dumps({**LONG, "stream": True}).encode()
        request = urllib.request.Request(
            server.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                for _ in r:
                    started.set()
        except OSError:
            pass  # the server went away: what the tests do to it
        started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert started.wait(120)
    return thread


def _gone_within(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.listdir(path):
            return True
        time.sleep(0.05)
    return False


# The worker is stopped (SIGSTOP) first, so the first signal's shutdown waits for it and
# the second signal, whatever its delay, lands while that shutdown runs.
@pytest.mark.parametrize("delay", [0.05, 0.5, 2.0])
def test_a_second_signal_while_the_server_stops_exits_cleanly(delay: float, tmp_path: Path) -> None:
    server = start_server(None, tmp_path / "tmp")
    _open_stream(server)
    children = children_of(server.proc.pid)
    os.kill(_child(server.proc, "worker.main"), signal.SIGSTOP)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(delay)  # the delay under test, not a wait for an event
    server.proc.send_signal(signal.SIGINT)
    code = server.proc.wait(timeout=60)
    gone = reap(children, server.tmp)
    stderr = server.watch.join()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert gone, "orphan processes"
    nothing_left(server, children)


def test_the_launcher_killed_while_it_stops_leaves_no_socket_folder(tmp_path: Path) -> None:
    server = start_server(None, tmp_path / "tmp")
    children = children_of(server.proc.pid)
    core, worker = _child(server.proc, "enginecore.core"), _child(server.proc, "worker.main")
    # An idle core stops at once; the stopped worker holds the launcher in its shutdown.
    os.kill(worker, signal.SIGSTOP)
    server.proc.send_signal(signal.SIGTERM)
    assert all_gone([core], timeout=60)
    assert server.proc.poll() is None, "the launcher should still wait for the worker"
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=60)
    try:
        assert _gone_within(server.tmp, 5), f"socket folder left: {os.listdir(server.tmp)}"
    finally:
        os.kill(worker, signal.SIGCONT)  # it then finds its launcher gone and exits
    nothing_left(server, children)


# A worker hook (PAGEDSERVE_WORKER_HOOKS) that, once told to by a file, hangs in its step
# and ignores SIGTERM: the watchdog fires, and stopping the engine's processes then takes
# seconds (until SIGKILL), as it does with a worker stuck in a device call.
HANG_HOOK = """
import os, signal, time
from worker.step_hooks import StepHooks

class Hang(StepHooks):
    def planning(self):
        if os.path.exists(os.environ["HANG_TRIGGER"]):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)

def install(runner):
    return Hang()
"""


def _server_with_hang_hook(tmp_path: Path, trigger: Path) -> Server:
    hook = tmp_path / "hang_hook.py"
    hook.write_text(HANG_HOOK)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "0", "--device", CPU]
    proc = subprocess.Popen(
        [*cmd, "--step-timeout", "2"],
        env={
            **ENV,
            "TMPDIR": str(tmp),
            "PAGEDSERVE_WORKER_HOOKS": f"{hook}:install",
            "HANG_TRIGGER": str(trigger),
        },
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    watch = StderrWatch(proc)
    url = watch.wait_for(r"on (https?://\S+)").group(1)
    return Server(proc, watch, url, tmp)


# /health is probed without pause from before the engine dies until the server closes:
# every probe sent after a request was refused (the engine known dead) must be 503 with
# the reason, though the engine's processes take seconds more to stop.
def test_health_is_503_as_soon_as_the_engine_is_dead(tmp_path: Path) -> None:
    trigger = tmp_path / "hang"
    server = _server_with_hang_hook(tmp_path, trigger)
    probes: list[tuple[float, int, str]] = []  # (sent at, status, body)

    def probe() -> None:
        while True:
            sent = time.monotonic()
            try:
                status, body = _call(server.url + "/health")
            except OSError:
                return  # the server has closed
            probes.append((sent, status, body))
            time.sleep(0.01)

    try:
        children = children_of(server.proc.pid)
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        trigger.touch()
        refused_at = None
        with contextlib.suppress(OSError):  # the server may close before a refusal
            while refused_at is None:
                if _call(server.url + "/v1/completions", SHORT)[0] == 503:
                    refused_at = time.monotonic()
        prober.join(timeout=60)
    finally:
        server.proc.wait(timeout=60)
    assert server.proc.returncode == 1
    assert refused_at is not None, "requests were never refused"
    after = [(status, body) for sent, status, body in probes if sent > refused_at]
    assert after, "no /health probe after the refusal"
    reason = "did not answer a step within 2 s"
    assert all(status == 503 and reason in body for status, body in after), after
    assert "Traceback" not in server.watch.join()
    nothing_left(server, children)


def test_a_second_signal_while_run_batch_stops_exits_cleanly(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    inp = tmp_path / "in.jsonl"
    line = {"custom_id": "r0", "method": "POST", "url": "/v1/completions", "body": LONG}
    inp.write_text(json.dumps(line) + "\n")
    cmd = [sys.executable, "-m", "launch.cli", "run-batch", "--device", CPU, "--log-level"]
    proc = subprocess.Popen(
        [*cmd, "INFO", "-i", str(inp), "-o", str(tmp_path / "out.jsonl")],
        env={**ENV, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )
    watch = StderrWatch(proc)
    watch.wait_for("KV cache: ")
    children = children_of(proc.pid)
    os.kill(_child(proc, "worker.main"), signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the delay under test
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    gone = reap(children, tmp)
    stderr = watch.join()
    assert "Traceback" not in stderr, stderr
    assert gone, "orphan processes"
    assert not os.listdir(tmp), "socket folder left behind"
