"""Building and loading the C attention kernel (pagedkernels.cpu_native): cached per source and
machine, and a build that fails leaves the gather path running with the same results.
Its numbers are tested against the reference in tests/kernels/test_cpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkernels import cpu_native

ROOT = Path(__file__).resolve().parents[2]

# Loads the library in a fresh process (the loaded library is cached per process), runs
# one mixed batch through pagedkernels.cpu and prints whether the C kernel served it.
PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from pagedkernels import cpu, cpu_native, reference
from pagedkernels.testing import random_paged_batch
gen = torch.Generator().manual_seed(3)
args = random_paged_batch(gen, [40, 300, 7], [1, 2, 7], 16, 2, 4, 64, torch.float32)
got = cpu.paged_attention(*args, 0.125)
torch.testing.assert_close(got, reference.paged_attention(*args, 0.125), rtol=1e-5, atol=1e-6)
print("native" if cpu_native.library() is not None else "gather")
"""


def probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, cpu_native.CACHE_ENV: str(tmp_path), **env}
    full.pop(cpu_native.NATIVE_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=full, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_the_build_is_cached_per_machine_and_reused(tmp_path: Path) -> None:
    first = probe(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["native"]
    built = list((tmp_path / "kernels").glob("paged_attention_cpu-*.so"))
    assert len(built) == 1, built
    assert f"built {built[0]}" in first.stderr
    stamp = built[0].stat().st_mtime_ns

    again = probe(tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["native"]
    assert "built " not in again.stderr  # loaded, not compiled again
    assert built[0].stat().st_mtime_ns == stamp
    # No temporary file left beside it (build.lock stays, for the next build to take).
    left = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert left == sorted([built[0].name, "build.lock"])


def test_a_failed_build_falls_back_to_the_gather_path(tmp_path: Path) -> None:
    # A compiler that answers --version and then fails, after creating its output file.
    fake = tmp_path / "fake-cc"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake-cc 1.0 && exit 0\n'
        'while [ "$1" != -o ]; do shift; done; touch "$2"\n'
        'echo "fake-cc: error: planted" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    done = probe(tmp_path / "cache", CC=str(fake))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["gather"]
    assert "CPU attention kernel not built" in done.stderr
    assert "fake-cc: error: planted" in done.stderr
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # its output removed


def test_ranks_starting_together_build_once(tmp_path: Path) -> None:
    # Three processes at once, as tensor-parallel ranks start: one compiles, the others
    # wait for it and load its library.
    env = {**os.environ, cpu_native.CACHE_ENV: str(tmp_path)}
    env.pop(cpu_native.NATIVE_ENV, None)
    cmd = [sys.executable, "-c", PROBE]
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=pipe, stderr=pipe)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert [out.split() for out, _ in results] == [["native"]] * 3
    assert sum("building the CPU attention kernel" in err for _, err in results) == 1
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_a_missing_compiler_is_named(tmp_path: Path) -> None:
    done = probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["gather"]
    assert "no-such-cc" in done.stderr


def test_the_switch_takes_only_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_NATIVE_KERNELS must be 0 or 1"):
        cpu_native.library()
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    assert cpu_native.library() is None
