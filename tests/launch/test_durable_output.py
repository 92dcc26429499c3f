"""The output files of `generate` and `run-batch` under abuse, through the real command line:
a signal or a kill mid-run keeps every finished answer as a valid line, a full disk stops
the run with one line that names the file, a failed start-up leaves an existing file as it
was, and `-` still writes to standard output. (`generate` killed outright:
tests/launch/client/test_lifecycle.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import (
    CPU,
    ENV,
    StderrWatch,
    all_gone,
    children_of,
    generate_cmd,
    processes_mentioning,
)

QUICK = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
# Runs for minutes on the built-in model: a run that holds it is not done on its own.
LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def _batch_line(i: int, options: dict) -> str:
    body = {"prompt": [11, 12, 13 + i], **options}
    return json.dumps(
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
    )


def _run_batch_cmd(inp: Path, out: Path | str, *flags: str) -> list[str]:
    return [
        *(sys.executable, "-m", "launch.cli", "run-batch", "--device", CPU, "--no-progress"),
        *("-i", str(inp), "-o", str(out), *flags),
    ]


def _start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen, StderrWatch, Path]:
    """cmd with its temporary directory (the socket folder) under tmp_path."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(cmd, env={**ENV, "TMPDIR": str(tmp)}, stderr=subprocess.PIPE, text=True)
    return proc, StderrWatch(proc), tmp


def _lines(out: Path) -> list[dict]:
    """Every line of out, each of which must be complete JSON."""
    raw = out.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the last line is cut"
    return [json.loads(x) for x in raw.splitlines()]


def _wait_for_lines(out: Path, want: int, timeout: float = 300) -> None:
    """Wait until out holds want lines (they are appended as requests end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{out} never held {want} lines")


def _nothing_left(children: list[int], tmp: Path) -> None:
    assert all_gone(children + processes_mentioning(str(tmp))), "orphan processes"
    assert not os.listdir(tmp), "socket folder left behind"


@pytest.mark.parametrize(
    ("sig", "status"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -9)],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_run_batch_stopped_mid_run_keeps_every_finished_answer(
    sig: signal.Signals, status: int, tmp_path: Path
) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(_batch_line(i, QUICK if i < 3 else LONG) + "\n" for i in range(4)))
    out.write_text("an old file, replaced once the engine is up\n")
    proc, watch, tmp = _start(_run_batch_cmd(inp, out), tmp_path)
    _wait_for_lines(out, 3)  # the quick ones are done, the long one runs
    assert "an old file" not in out.read_text()
    children = children_of(proc.pid)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == status, watch.join()
    stderr = watch.join()
    lines = _lines(out)
    assert sorted(x["custom_id"] for x in lines) == ["r0", "r1", "r2"]
    assert all(x["response"]["status_code"] == 200 for x in lines)
    if sig != signal.SIGKILL:
        assert f"pagedserve run-batch: interrupted; 3 finished results are in {out}" in stderr
        assert "Traceback" not in stderr, stderr
    _nothing_left(children, tmp)


def _small_disk(tmp_path: Path) -> Iterator[Path]:
    """An output path on a 16 KiB tmpfs where this test may mount one, else /dev/full."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        yield Path("/dev/full")
        return
    try:
        yield disk / "out.jsonl"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def full_disk_output(tmp_path: Path) -> Iterator[Path]:
    yield from _small_disk(tmp_path)


def _generate_line(i: int, options: dict) -> str:
    return json.dumps({"prompt_token_ids": [11, 12, 13 + i], **options})


@pytest.mark.parametrize("command", ["run-batch", "generate"])
def test_a_full_disk_stops_the_run_with_one_line_and_only_complete_lines(
    command: str, full_disk_output: Path, tmp_path: Path
) -> None:
    # More quick answers than 16 KiB holds, and one that would run for minutes: the run
    # must stop at the first failed write, not compute the rest.
    inp, out = tmp_path / "in.jsonl", full_disk_output
    line = _batch_line if command == "run-batch" else _generate_line
    inp.write_text("".join(line(i, LONG if i == 0 else QUICK) + "\n" for i in range(300)))
    cmd = _run_batch_cmd(inp, out) if command == "run-batch" else generate_cmd(inp, out)
    proc, watch, tmp = _start(cmd, tmp_path)
    children = children_of(proc.pid)
    assert proc.wait(timeout=120) == 1, watch.join()
    stderr = watch.join()
    said = [x for x in stderr.splitlines() if x.startswith(f"pagedserve {command}:")]
    held = 0 if out == Path("/dev/full") else len(_lines(out))
    assert said == [
        f"pagedserve {command}: cannot write {out}: No space left on device (errno 28); "
        f"it holds {held} complete results"
    ], stderr
    assert "Traceback" not in stderr, stderr
    assert held < 300
    _nothing_left(children, tmp)


@pytest.mark.parametrize("command", ["run-batch", "generate"])
def test_a_failed_start_up_leaves_an_existing_output_as_it_was(
    command: str, tmp_path: Path
) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text((_batch_line(0, QUICK) if command == "run-batch" else "{}") + "\n")
    out.write_bytes(b"last week's results\n")
    fresh = tmp_path / "fresh.jsonl"
    model = ("--model", "no-such-org/no-such-model")
    offline = {**ENV, "HF_HUB_OFFLINE": "1"}
    for target in (out, fresh):
        if command == "run-batch":
            cmd = _run_batch_cmd(inp, target, *model)
        else:
            cmd = generate_cmd(inp, target, *model)
        proc = subprocess.run(cmd, env=offline, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "no-such-org/no-such-model" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    assert out.read_bytes() == b"last week's results\n"
    assert not fresh.exists()  # not left behind empty


@pytest.mark.parametrize("command", ["run-batch", "generate"])
def test_a_dash_writes_the_answers_to_standard_output(command: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    line = _batch_line if command == "run-batch" else _generate_line
    inp.write_text("".join(line(i, QUICK) + "\n" for i in range(2)))
    cmd = _run_batch_cmd(inp, "-") if command == "run-batch" else generate_cmd(inp, Path("-"))
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 2 and not (tmp_path / "-").exists()
    assert not Path("-").exists()
