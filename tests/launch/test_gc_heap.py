"""Our processes keep the cyclic collector off their start-up heap (protocol/gc_heap.py):
`generate` and its core and worker each freeze what is alive once serving starts, so a
full collection never walks a model's heap between two tokens. Checked in the real
processes: a sitecustomize on their PYTHONPATH records each one's frozen object count at
exit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers.cli_helpers import ENV, generate_cmd

ROOT = Path(__file__).resolve().parents[2]
RECORDER = """
import atexit, gc, json, os, sys
def _record():
    path = os.path.join(os.environ["GC_HEAP_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "frozen": gc.get_freeze_count()}, f)
atexit.register(_record)
"""


def test_generate_core_and_worker_freeze_their_start_up_heap(tmp_path: Path) -> None:
    site, records = tmp_path / "site", tmp_path / "records"
    site.mkdir()
    records.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": [11, 12, 13], "max_tokens": 4}) + "\n")
    env = {**ENV, "PYTHONPATH": f"{site}:{ROOT}", "GC_HEAP_DIR": str(records)}
    proc = subprocess.run(
        generate_cmd(inp, out), env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen = {}
    for path in records.iterdir():
        record = json.loads(path.read_text())
        program = record["argv"][0]  # the rest names paths under this test's own name
        role = next((r for r in ("worker", "enginecore", "launch") if r in program), program)
        frozen[role] = record["frozen"]
    # A start-up heap holds tens of thousands of objects (modules, a model, a tokenizer).
    assert set(frozen) >= {"worker", "enginecore", "launch"}, frozen
    assert all(n > 10_000 for n in frozen.values()), frozen
