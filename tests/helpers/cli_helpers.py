"""Running `pagedserve generate` as a user would: a real subprocess, files in and out."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The core checks every KV invariant after each step and that no block leaks at idle.
ENV = dict(os.environ, PAGEDSERVE_CHECK_INVARIANTS="1")


# The tests compare with float32 oracles computed on the CPU. On a machine with a GPU the
# engine's default (cuda, bfloat16) would change the arithmetic, so every engine a test
# starts runs on the CPU unless the test names a device itself (the GPU tests do).
CPU = "cpu"


def generate_cmd(inp: Path, out: Path, *flags: str, model: Path | str | None = None) -> list[str]:
    """The `pagedserve generate` command line (the built-in model when model is None)."""
    cmd = [sys.executable, "-m", "launch.cli", "generate"]
    if model is not None:
        cmd += ["--model", str(model)]
    if "--device" not in flags:
        cmd += ["--device", CPU]
    return [*cmd, "--input", str(inp), "--output", str(out), "--no-progress", *flags]


def generate_cli(
    model: Path | str | None,
    lines: list[str],
    tmp: Path,
    *flags: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """Run generate over raw input lines; (the process, the parsed output lines). env adds
    variables to the tests' environment."""
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(line + "\n" for line in lines))
    proc = subprocess.run(
        generate_cmd(inp, out, *flags, model=model),
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        timeout=600,
        check=False,
    )
    results = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc, results


ROOT = Path(__file__).resolve().parents[2]


def run_json_script(script: str, *args: str, cwd: Path | None = None) -> dict[str, Any]:
    """Run a script of the repository (`benchmarks/x.py`, `examples/y.py`) as a user
    would, with the tests' environment; its last stdout line, parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        env={**ENV, "PYTHONPATH": str(ROOT)},
        timeout=600,
        check=False,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class StderrWatch:
    """Reads a process's stderr line by line on a thread, so a test can wait for a line
    (an event the process reports) instead of sleeping, and still get all of it later."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self._done = True
            self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match[str]:
        """The first match of pattern in a line; fails if the stream ends without one.
        The timeout only keeps a broken run from hanging the suite."""
        regex = re.compile(pattern)
        seen = 0
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    raise AssertionError(f"no line matching {pattern!r}:\n{self.text()}")
                self._new.wait(left)

    def text(self) -> str:
        """Everything read so far (all of it once the process has exited and join() ran)."""
        return "".join(self.lines)

    def join(self) -> str:
        self._thread.join()
        return self.text()


def children_of(pid: int) -> list[int]:
    """Pids of pid's direct children."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def all_gone(pids: list[int], timeout: float = 60.0) -> bool:
    """True once every pid has exited (zombies count as gone); False after timeout, which
    only keeps a broken run from hanging the suite."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists() and " Z " not in Path(f"/proc/{p}/stat").read_text()
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains text (an engine's processes carry their socket
    folder in their configuration), so a test finds every member of a group, even one
    spawned after it last looked."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline:
                pids.append(int(entry))
    return pids


def reap(children: list[int], tmp: Path) -> bool:
    """Whether every process of the group exited within a generous bound. Survivors are
    killed, so that a failing run ends instead of hanging on a stopped orphan that holds
    the stderr pipe open."""
    pids = children + processes_mentioning(str(tmp))
    if all_gone(pids, timeout=30):
        return True
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return False
