"""The vLLM peer, optional and kept outside this repository: where its scripts
($PEER_SCRIPTS) and venvs ($PEERS_DIR) are, and running one of its scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "peers"))
PEER_SCRIPTS = Path(os.environ.get("PEER_SCRIPTS", ROOT.parent / "shared" / "peers" / "vllm"))
PEER_PYTHON = PEERS_DIR / "vllm-venv" / "bin" / "python"


def run_peer_script(
    python: Path, script: Path, args: list[str], what: str
) -> dict[str, Any] | None:
    """The JSON a peer script prints, or None (said on stderr) when it is absent or fails."""
    if not (python.exists() and script.exists()):
        print(
            f"vLLM peer not found ({python}); run {PEER_SCRIPTS}/setup.sh to compare",
            file=sys.stderr,
            flush=True,
        )
        return None
    print(
        f"running vLLM's {what} on the same workload ({script.name})", file=sys.stderr, flush=True
    )
    out = subprocess.run(
        [str(python), str(script), *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        print(f"vLLM peer failed:\n{out.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(out.stdout)
