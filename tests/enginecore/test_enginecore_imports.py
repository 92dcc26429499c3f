"""The control plane stays CUDA-free: importing all of enginecore loads no torch or cupy.
And the client never imports enginecore (the core is a process it starts): what both
read lives in protocol/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def test_the_client_never_imports_enginecore() -> None:
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "launch" / "client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "enginecore"]
    assert not found, found
