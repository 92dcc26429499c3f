"""The process group's lifecycle, as a user's shell or a job scheduler drives it: signals
at any moment, a launcher killed outright, bad paths. Each case asserts the exit status,
the message, that no process of the group survives, that the socket folder is gone, and
that every result finished before the end is in the output file as valid JSON."""

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
    all_gone,
    children_of,
    generate_cmd,
    processes_mentioning,
)

# Three quick requests and one that runs for minutes on the built-in model.
LINES = [{"prompt": "ab", "max_tokens": 4, "ignore_eos": True}] * 3 + [
    {"prompt": "cd", "max_tokens": 4000, "ignore_eos": True}
]


def _start(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, StderrWatch, Path, Path]:
    """`pagedserve generate` with its temporary directory (socket folders) under tmp_path."""
    inp, out, tmp = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "tmp"
    tmp.mkdir()
    inp.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    proc = subprocess.Popen(
        generate_cmd(inp, out, "--log-level", "INFO", *flags),
        env={**ENV, "TMPDIR": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, StderrWatch(proc), out, tmp


def _child(children: list[int], module: str) -> int:
    """The pid of the child running `python -m module`."""
    (pid,) = [p for p in children if module in Path(f"/proc/{p}/cmdline").read_text()]
    return pid


def _results(out: Path) -> list[dict]:
    return sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"])


def _check_nothing_left(children: list[int], tmp: Path) -> None:
    """No process of the group alive (found by the socket folder in their command lines
    too), no socket folder left."""
    assert all_gone(children + processes_mentioning(str(tmp))), "orphan processes"
    assert not os.listdir(tmp), "socket folder left behind"


def _finished_lines(out: Path, want: int, timeout: float = 300) -> list[dict]:
    """Wait until out holds want results (they are appended as requests end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists():
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            if len(lines) >= want:
                return lines
        time.sleep(0.05)
    raise AssertionError(f"{out} never held {want} results")


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_mid_run_keeps_finished_results(
    sig: signal.Signals, status: int, tmp_path: Path
) -> None:
    proc, watch, out, tmp = _start(tmp_path)
    _finished_lines(out, 3)  # the quick ones are done, the long one runs
    children = children_of(proc.pid)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == status, watch.join()
    stderr = watch.join()
    assert "interrupted; 3 finished results" in stderr and "1 requests were cut short" in stderr
    assert "Traceback" not in stderr, stderr
    lines = _results(out)
    assert [r["index"] for r in lines] == [0, 1, 2]
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 4 for r in lines)
    _check_nothing_left(children, tmp)


def test_a_launcher_killed_outright_takes_the_group_down(tmp_path: Path) -> None:
    proc, _, out, tmp = _start(tmp_path)
    _finished_lines(out, 3)
    children = children_of(proc.pid)
    assert len(children) == 2
    proc.send_signal(signal.SIGKILL)  # no handler runs: the core and worker must notice
    proc.wait()
    _check_nothing_left(children, tmp)
    # What finished before the kill is on disk.
    assert [r["index"] for r in _results(out)] == [0, 1, 2]


def test_an_unwritable_output_fails_before_the_engine_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n")
    proc = subprocess.run(
        generate_cmd(inp, blocker / "out.jsonl"), env=ENV, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert str(blocker) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "KV cache" not in proc.stderr and "attention kernels" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "tpu"), "device must be auto, cpu, cuda or cuda:N, not 'tpu'"),
        (("--input-is-a-directory",), "input file is not a file"),
    ],
)
def test_bad_paths_and_flags_are_one_line_errors(
    flags: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n")
    if flags == ("--input-is-a-directory",):
        inp, flags = tmp_path, ()
    proc = subprocess.run(
        generate_cmd(inp, tmp_path / "out.jsonl", *flags),
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert proc.returncode in (1, 2)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_stopped_worker_is_named_by_the_watchdog(tmp_path: Path) -> None:
    proc, watch, out, tmp = _start(tmp_path, "--step-timeout", "5")
    _finished_lines(out, 3)
    children = children_of(proc.pid)
    os.kill(
        _child(children, "worker.main"), signal.SIGSTOP
    )  # alive but silent, as a hung collective would be
    assert proc.wait(timeout=300) == 1
    stderr = watch.join()
    assert "worker rank 0 did not answer a step within 5 s (--step-timeout)" in stderr, stderr
    lines = _results(out)
    assert [r["finish_reason"] for r in lines] == ["length"] * 3 + ["error"]
    assert "did not answer a step" in lines[3]["error"]
    _check_nothing_left(children, tmp)


def test_a_killed_core_keeps_finished_results_and_fails_the_rest(tmp_path: Path) -> None:
    proc, watch, out, tmp = _start(tmp_path)
    _finished_lines(out, 3)
    children = children_of(proc.pid)
    os.kill(_child(children, "enginecore.core"), signal.SIGKILL)
    assert proc.wait(timeout=300) == 1
    stderr = watch.join()
    assert "engine core" in stderr and "killed by signal 9" in stderr, stderr
    lines = _results(out)
    assert [r["finish_reason"] for r in lines] == ["length"] * 3 + ["error"]
    assert "killed by signal 9" in lines[3]["error"]
    _check_nothing_left(children, tmp)
