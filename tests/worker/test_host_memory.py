"""worker/host_memory.py: glibc takes the settings that keep freed memory for the next step.
Run in a child interpreter, so this test process's allocator is left as it was."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    platform.system() != "Linux" or ctypes.util.find_library("c") != "libc.so.6",
    reason="glibc only",
)
def test_glibc_accepts_the_settings() -> None:
    code = "from worker.host_memory import keep_freed_memory; print(keep_freed_memory())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
