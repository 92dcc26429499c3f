"""The control plane stays CUDA-free: importing all of enginecore loads no torch or cupy."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import importlib, pkgutil, sys
import enginecore
names = [m.name for m in pkgutil.walk_packages(enginecore.__path__, "enginecore.")]
for name in names:
    importlib.import_module(name)
bad = [n for n in ("torch", "cupy") if n in sys.modules]
print(len(names), ",".join(bad))
"""


def test_enginecore_imports_neither_torch_nor_cupy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) >= 8  # every module was walked, not an empty package
    assert len(out) == 1, f"enginecore imported {out[1]}"
