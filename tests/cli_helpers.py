"""Running `pagedserve generate` as a user would: a real subprocess, files in and out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    model: Path | str, lines: list[str], tmp: Path, *flags: str, env: dict[str, str] | None = None
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
