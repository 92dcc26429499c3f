"""Plant known bugs in a copy of the repository and check that the suite catches each one,
for every checkpoint family it applies to. Run by hand after any large change to the
attention, KV or worker input path (not in CI: it runs the oracle tests once per bug):

    python tests/helpers/mutations.py [--only NAME ...] [--json report.json]

Each mutation replaces one exact piece of source (it must occur exactly once, so a
refactor that moves the code makes the script fail loudly rather than test nothing).
A mutation counts as caught for a family when at least one end-to-end or logit test of
that family fails; the report names the tests that did.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL = (
    "llama",
    "qwen2",
    "mistral",
    "qwen2_interleaved",
    "qwen2_5to1",
    "llama_d128",
    "qwen3",
    "gemma3",
    "gemma3_softcap",
)
SLIDING = ("mistral", "qwen2_interleaved", "qwen2_5to1", "gemma3", "gemma3_softcap")
# The oracle tests: greedy tokens of the whole engine (TP 1 and 2) and logits at every
# position through the real runner (TP 1 and 2) and through the unit-test harness.
ORACLE_TESTS = (
    "tests/launch/client/test_engine_e2e.py",
    "tests/worker/test_model_runner.py",
    "tests/worker/test_llama.py::test_paged_batches_match_transformers",
)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    families: tuple[str, ...] = ALL


MUTATIONS = [
    Mutation(
        "o_proj zeroed (attention contributes nothing)",
        "worker/models/llama.py",
        "return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))",
        "return self.o_proj(0 * out.view(num_tokens, self.num_heads * self.head_dim))",
    ),
    Mutation(
        "attention scale x1.25",
        "worker/models/llama.py",
        "self.scale = self.head_dim**-0.5",
        "self.scale = 1.25 * self.head_dim**-0.5",
    ),
    Mutation(
        "within-block slot offset reversed",
        "worker/block_table.py",
        "slots = block_ids.astype(np.int64) * bs + pos % bs",
        "slots = block_ids.astype(np.int64) * bs + (bs - 1 - pos % bs)",
    ),
    Mutation(
        "Llama-3 RoPE bands swapped (short wavelengths scaled, long ones kept)",
        "worker/layers.py",
        "scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)",
        "scaled = torch.where(wavelen < high_freq_wavelen, inv_freq / scaling.factor, inv_freq)",
        ("llama",),  # the only family with llama3 rope scaling
    ),
    Mutation(
        "sliding window one key too wide",
        "worker/models/llama.py",
        "sliding_window=self.sliding_window,",
        "sliding_window=self.sliding_window and self.sliding_window + 1,",
        SLIDING,
    ),
    Mutation(
        "sliding window one key too narrow",
        "worker/models/llama.py",
        "sliding_window=self.sliding_window,",
        "sliding_window=self.sliding_window and self.sliding_window - 1,",
        SLIDING,
    ),
    Mutation(
        "block-table row of another request",
        "worker/model_runner.py",
        "block_tables=[t[:, :w].index_select(0, rows) for t, w in zip(tables, widths)],",
        "block_tables=[t[:, :w].index_select(0, rows.roll(1)) for t, w in zip(tables, widths)],",
    ),
    Mutation(
        "null block read as a real block (keys before the window are read, masked)",
        "pagedkernels/reference.py",
        "first_key = 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)",
        "first_key = 0",
        SLIDING,
    ),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", ".ruff_cache")
    shutil.copytree(ROOT, dest, ignore=ignore)


def _apply(tree: Path, m: Mutation) -> None:
    path = tree / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutation {m.name!r}: {m.path} has {count} copies of {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def _families_of(test_id: str) -> set[str]:
    """The checkpoint families a test id names in its parameters."""
    params = re.search(r"\[(.*)\]$", test_id)
    if params is None:
        return set()
    tokens = set(re.split(r"-", params.group(1)))
    return {f for f in ALL if f in tokens}


def run_suite(tree: Path) -> tuple[list[str], str]:
    """Failed test ids of the oracle tests in tree, and pytest's output."""
    env = dict(os.environ, PYTHONPATH=str(tree))  # the copy, not an editable install
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *ORACLE_TESTS],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, flags=re.MULTILINE)
    return failed, proc.stdout + proc.stderr


def check_mutation(m: Mutation) -> dict:
    with tempfile.TemporaryDirectory(prefix="pagedserve-mutant-") as tmp:
        tree = Path(tmp) / "repo"
        _copy_repo(tree)
        _apply(tree, m)
        failed, output = run_suite(tree)
    caught_by = {f: sorted(t for t in failed if f in _families_of(t)) for f in m.families}
    missed = [f for f, tests in caught_by.items() if not tests]
    return {
        "mutation": m.name,
        "file": m.path,
        "caught_by": caught_by,
        "missed": missed,
        "failed_tests": len(failed),
        "output_tail": output[-3000:] if missed else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run the mutations whose name contains these")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]

    baseline, output = run_suite(ROOT)
    if baseline:
        print(output, file=sys.stderr)
        raise SystemExit(f"the unmutated suite fails ({len(baseline)} tests): fix that first")
    reports = []
    for m in chosen:
        print(f"mutation: {m.name} ...", file=sys.stderr, flush=True)
        report = check_mutation(m)
        reports.append(report)
        for family, tests in report["caught_by"].items():
            shown = ", ".join(t.split("::", 1)[1] for t in tests[:3]) if tests else "MISSED"
            more = f" (+{len(tests) - 3} more)" if len(tests) > 3 else ""
            print(f"  {family:18s} {len(tests):3d} failed: {shown}{more}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    missed = [(r["mutation"], r["missed"]) for r in reports if r["missed"]]
    print(json.dumps({"mutations": len(reports), "missed": missed}))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
