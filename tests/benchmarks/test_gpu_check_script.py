"""benchmarks/gpu_check.sh, the one script a lent GPU runs, end to end on the CPU.

With --emulate every step runs here: the NVRTC compile check, the GPU test files (their
GPU tests skip), the engine in half precision, the correctness sweep and the benchmark
with the kernels on the CPU emulator at small shapes. The numbers mean nothing; what is
checked is that the script and its JSON work before a GPU machine's minutes go to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ("nvrtc", "pytest", "e2e", "check", "bench")
# One log per kind of step (the end-to-end tests append to pytest.log), the two JSON
# reports and the summary; sanitizer.log only where compute-sanitizer ran.
EMULATED_RESULTS = {
    "nvrtc.log",
    "pytest.log",
    "check.log",
    "bench.log",
    "check.json",
    "bench.json",
    "summary.json",
}


def run_script(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_gpu_check_runs_every_step_on_the_emulator(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--emulate")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {step: summary[step] for step in STEPS} == dict.fromkeys(STEPS, 0)
    assert summary["failed"] == 0
    # compute-sanitizer needs the GPU: reported as skipped, not as passed.
    assert summary["memcheck"] == summary["racecheck"] == "skipped"
    assert summary["environment"]["kernels"] == "emulated on the CPU"
    # Exactly the files the script documents, every one in $OUT and nothing else.
    assert {p.name for p in tmp_path.iterdir()} == EMULATED_RESULTS
    assert json.loads((tmp_path / "summary.json").read_text()) == summary

    check = json.loads((tmp_path / "check.json").read_text())
    assert check["failed"] == 0 and check["passed"] == len(check["cases"]) >= 8
    assert any(c.get("splits", 1) > 1 for c in check["cases"])  # split-K reduction ran

    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["copy_bandwidth_gbps_read_plus_write"] > 0
    decode_keys = {"kernel_ms", "kernel_gbps", "fraction_of_copy_bw", "speedup_vs_sdpa"}
    assert bench["decode"] and all(decode_keys <= set(row) for row in bench["decode"])
    assert bench["prefill"] and all("speedup_vs_sdpa" in row for row in bench["prefill"])
    targets = bench["targets"]
    assert targets == summary["targets"] and targets["cases"] >= 1
    assert isinstance(targets["fraction_of_copy_bw_met"], bool)


def test_gpu_check_refuses_unknown_flags(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--fast")
    assert proc.returncode == 2 and "usage:" in proc.stderr
