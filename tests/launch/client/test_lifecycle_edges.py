"""The edges of the process group's life under `pagedserve generate`: a process that dies at
any moment of start-up is noticed within seconds and named; a second stop signal while the
first one's shutdown runs neither raises nor leaves anything behind. Each case asserts the
exit status, the message, no "Traceback", no process of the group alive, no socket folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import (
    ENV,
    StderrWatch,
    children_of,
    generate_cmd,
    reap,
)

# Two quick requests and one that runs for minutes on the built-in model.
LINES = [{"prompt": "ab", "max_tokens": 4, "ignore_eos": True}] * 2 + [
    {"prompt": "cd", "max_tokens": 4000, "ignore_eos": True}
]
# Generous for a loaded 2-core machine; before start-up watched its children, a worker
# lost before it connected went unnoticed for over a minute.
STARTUP_FAILURE_S = 15


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], StderrWatch, Path, Path]:
    """`pagedserve generate` with its socket folder under tmp_path/tmp."""
    inp, out, tmp = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "tmp"
    tmp.mkdir()
    inp.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    proc = subprocess.Popen(
        generate_cmd(inp, out, "--log-level", "INFO"),
        env={**ENV, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, StderrWatch(proc), out, tmp


def _wait_for_child(proc: subprocess.Popen[str], module: str, timeout: float = 120) -> int:
    """The pid of proc's child running `python -m module`, as soon as it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in children_of(proc.pid):
            try:
                if module in Path(f"/proc/{pid}/cmdline").read_text():
                    return pid
            except OSError:
                continue
        time.sleep(0.005)
    raise AssertionError(f"no {module} child appeared")


def _finished_lines(out: Path, want: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and len(out.read_text().splitlines()) >= want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{out} never held {want} results")


def _check_nothing_left(children: list[int], tmp: Path) -> None:
    assert reap(children, tmp), "orphan processes"
    assert not os.listdir(tmp), "socket folder left behind"


# When the worker is killed: as soon as it exists (before it connects to the core, which
# then cannot know), once it is loading the model, and once it has connected.
@pytest.mark.parametrize("when", [None, r"worker rank 0: loading", r"rank 0: \w+ForCausalLM on"])
def test_a_worker_killed_during_start_up_fails_it_within_seconds(
    when: str | None, tmp_path: Path
) -> None:
    proc, watch, _, tmp = _start(tmp_path)
    worker = _wait_for_child(proc, "worker.main")
    if when is not None:
        watch.wait_for(when)
    children = children_of(proc.pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(timeout=120) == 1
    took = time.monotonic() - killed
    stderr = watch.join()
    assert took < STARTUP_FAILURE_S, f"start-up failed {took:.1f} s after the worker died"
    assert "worker rank 0" in stderr and "killed by signal 9" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    _check_nothing_left(children, tmp)


def test_a_core_killed_during_start_up_fails_it_within_seconds(tmp_path: Path) -> None:
    proc, watch, _, tmp = _start(tmp_path)
    core = _wait_for_child(proc, "enginecore.core")
    watch.wait_for("engine core: waiting for 1 worker")
    children = children_of(proc.pid)
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(timeout=120) == 1
    assert time.monotonic() - killed < STARTUP_FAILURE_S
    stderr = watch.join()
    assert "engine core" in stderr and "killed by signal 9" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    _check_nothing_left(children, tmp)


# The worker is stopped (SIGSTOP) first, so the first signal's shutdown waits for it and
# the second signal, whatever its delay, lands while that shutdown runs.
@pytest.mark.parametrize("delay", [0.05, 0.5, 2.0])
def test_a_second_signal_during_shutdown_exits_cleanly(delay: float, tmp_path: Path) -> None:
    proc, watch, out, tmp = _start(tmp_path)
    _finished_lines(out, 2)
    children = children_of(proc.pid)
    worker = _wait_for_child(proc, "worker.main")
    os.kill(worker, signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    time.sleep(delay)  # the delay under test, not a wait for an event
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    gone = reap([*children, worker], tmp)
    stderr = watch.join()
    assert code == 143, stderr
    assert "Traceback" not in stderr, stderr
    assert "interrupted; 2 finished results" in stderr, stderr
    assert gone, "orphan processes"
    assert not os.listdir(tmp), "socket folder left behind"
    assert len(out.read_text().splitlines()) == 2
