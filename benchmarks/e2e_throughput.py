#!/usr/bin/env python3
"""End-to-end throughput on the real model (SmolLM2-135M-Instruct, float32): pagedserve
against vLLM's CPU backend and transformers, on the same token ids, interleaved.

    python benchmarks/e2e_throughput.py [--repeat 2] [--workloads shared,unique]
        [--engines ours,peer,transformers] [--no-ttft] [--keep DIR]

Workloads (JSONL in `pagedserve generate`'s input format, with `prompt_token_ids` so
every engine sees identical ids; greedy, ignore_eos, so each engine generates exactly
max_tokens per request):
- shared: 32 requests, 4 shared ~200-token prefixes + unique ~30-token questions, 64 tokens.
- unique: 64 requests without a shared prefix (no two share their first 16 tokens),
  100-300 prompt tokens, 128 tokens.

Engines, each a separate command per run, in an order rotated every repeat (the machine
is shared, so a load change should not always fall on the same engine):
- ours: `pagedserve generate --input W --output O` as a user runs it. Output tokens are
  counted in O; gen_s is the generate phase from its summary line (first request sent
  to last output; start-up and shutdown excluded); whole_s is the whole command.
- peer: the vLLM peer's bench_e2e.py (vLLM 0.32 LLM.generate, CPU backend; peer.py) in
  $PEERS_DIR/vllm-full-venv (made by setup-full.sh); gen_s is its LLM.generate time.
  Skipped with a note in the JSON when that venv or script is absent.
- transformers: this file with --hf-worker in a subprocess: AutoModelForCausalLM float32,
  left padding, greedy `generate` (EOS not stopping), all requests in one batch unless
  --hf-batch-size; gen_s covers the batches' generate calls.

Time to first token: no engine here reports per-request first-token times the same way
(the CLI writes results as requests finish), so --ttft (default on) runs every engine
again on the workload with max_tokens=1 and reports first_token_all_s: the time from
submitting all requests at once until every one has its first token (prefill of the
whole batch, engine already loaded), measured as each engine's gen_s.

Equal footing: float32 everywhere; the KV cache is --kv-cache-gib for ours
(--kv-cache-memory) and the peer (VLLM_CPU_KVCACHE_SPACE); prefix caching on for both.
Threads: ours picks its worker's torch threads itself, by timing (one core less or every
core; OMP_NUM_THREADS overrides), the peer binds its own OpenMP threads (its log line is
reported; it reserves a core for its scheduler), transformers uses --hf-threads
(default: the most our worker uses). Token agreement: for each pair of engines
the fraction of requests with identical greedy ids, and where they differ the first
differing position. Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from peer import PEER_SCRIPTS, PEERS_DIR  # noqa: E402

from tests.helpers.real_model import fetch_real_model  # noqa: E402

PEER_PYTHON = PEERS_DIR / "vllm-full-venv" / "bin" / "python"
PEER_SCRIPT = PEER_SCRIPTS / "bench_e2e.py"
ENGINES = ("ours", "peer", "transformers")
SUMMARY_RE = re.compile(
    r"output tokens: (?P<tokens>\d+) in (?P<seconds>[\d.]+) s .*?prefix-cache hit rate: "
    r"(?P<hit>[\d.]+)% \| preemptions: (?P<preempt>\d+)"
)
# vLLM's CPU backend logs its OpenMP binding (to stdout); kept so the report says what it used.
PEER_THREADS_RE = re.compile(
    r"VLLM_CPU_OMP_THREADS_BIND=[^,\s]+|core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\]"
)


def log(msg: str) -> None:
    print(f"[e2e_throughput] {msg}", file=sys.stderr, flush=True)


# -- workloads ----------------------------------------------------------------------
# Plain English from templates, not random ids: a trained model's greedy choices on
# real text have wider top-2 margins, so engine disagreements mean something.
NAMES = ["Ada", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun"]
THINGS = ["invoice", "parcel", "laptop", "ticket", "refund", "badge", "contract", "router"]
PLACES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Perth", "Quebec"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ACTIONS = ["approve", "ship", "repair", "cancel", "inspect", "renew", "archive", "reset"]
TEAMS = ["billing", "logistics", "support", "security", "legal", "network", "sales"]


def _sentence(rng: random.Random) -> str:
    forms = [
        "The {team} team in {place} must {action} every {thing} before {day}.",
        "{name} handles each {thing} that arrives from {place} on {day}.",
        "A {thing} older than {n} days goes to the {team} team, who {action} it.",
        "On {day}, nobody may {action} a {thing} without asking {name} first.",
        "Customers in {place} pay {n} euros to {action} a {thing}.",
        "If a {thing} is lost, {name} from {team} files a report within {n} hours.",
    ]
    return rng.choice(forms).format(
        team=rng.choice(TEAMS),
        place=rng.choice(PLACES),
        action=rng.choice(ACTIONS),
        thing=rng.choice(THINGS),
        day=rng.choice(DAYS),
        name=rng.choice(NAMES),
        n=rng.randint(2, 90),
    )


def _question(rng: random.Random) -> str:
    return (
        f"Question from {rng.choice(NAMES)}: my {rng.choice(THINGS)} is in "
        f"{rng.choice(PLACES)} and it is {rng.choice(DAYS)}. Who should "
        f"{rng.choice(ACTIONS)} it, and what happens next? Answer:"
    )


def _ids_of_length(tok: Any, rng: random.Random, header: str, n: int, make: Any) -> list[int]:
    """Token ids of header + sentences, cut to exactly n tokens."""
    text = header
    ids: list[int] = tok.encode(text).ids
    while len(ids) < n:
        text += " " + make(rng)
        ids = tok.encode(text).ids
    return ids[:n]


def build_workloads(model_dir: Path, seed: int) -> dict[str, list[dict[str, Any]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    common = {"temperature": 0.0, "ignore_eos": True}

    prefixes = [
        _ids_of_length(
            tok,
            rng,
            f"Handbook {k + 1} of the {rng.choice(PLACES)} office. Rules:",
            rng.randint(192, 208),
            _sentence,
        )
        for k in range(4)
    ]
    shared = []
    for i in range(32):
        question = _ids_of_length(tok, rng, "\n", rng.randint(26, 34), _question)
        shared.append({"prompt_token_ids": prefixes[i % 4] + question, "max_tokens": 64, **common})

    unique = []
    for i in range(64):
        header = f"Case {i * 7919 % 1000}, {rng.choice(NAMES)} in {rng.choice(PLACES)}:"
        ids = _ids_of_length(tok, rng, header, rng.randint(100, 300), _sentence)
        unique.append({"prompt_token_ids": ids, "max_tokens": 128, **common})
    # "No shared prefix" must hold at block granularity, or prefix caching would hit.
    heads = {tuple(r["prompt_token_ids"][:16]) for r in unique}
    assert len(heads) == len(unique), "unique workload has prompts sharing a 16-token block"
    return {"shared": shared, "unique": unique}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def ttft_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "max_tokens": 1} for r in rows]


# -- engines ------------------------------------------------------------------------
def _run(cmd: list[str], env: dict[str, str] | None, log_path: Path) -> tuple[int, float, str]:
    """(exit status, wall seconds, stderr) of a command; stderr is also kept on disk."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    # Both streams: vLLM logs to stdout, our CLI prints its summary on stderr.
    text = proc.stdout + "\n" + proc.stderr
    log_path.write_text(text)
    return proc.returncode, wall, text


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _pagedserve_cmd() -> list[str]:
    script = Path(sys.executable).parent / "pagedserve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())"]


def generate_cmd(model: Path, workload: Path, out: Path, *flags: str) -> list[str]:
    """`pagedserve generate` of workload into out on the real model in float32."""
    cmd = [*_pagedserve_cmd(), "generate", "--model", str(model), "--input", str(workload)]
    return [*cmd, "--output", str(out), "--dtype", "float32", *flags, "--no-progress"]


def run_ours(model: Path, workload: Path, work: Path, tag: str, a: argparse.Namespace) -> dict:
    out = work / f"ours-{tag}.jsonl"
    cmd = generate_cmd(model, workload, out, "--kv-cache-memory", str(a.kv_cache_gib * 2**30))
    rc, wall, err = _run(cmd, None, work / f"ours-{tag}.log")
    if rc != 0:
        raise RuntimeError(f"pagedserve generate exited {rc}:\n{err[-3000:]}")
    m = SUMMARY_RE.search(err)
    if m is None:
        raise RuntimeError(f"no summary line in pagedserve's stderr:\n{err[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    token_ids = [r["token_ids"] for r in rows]
    ntok = sum(len(t) for t in token_ids)
    gen_s = float(m["seconds"])
    return {
        "whole_s": round(wall, 3),
        "gen_s": gen_s,
        # Start-up plus shutdown: the whole command less the generate phase.
        "load_s": round(wall - gen_s, 3),
        "output_tokens": ntok,
        "output_tok_s": round(ntok / gen_s, 2),
        "prefix_hit_rate": float(m["hit"]) / 100,
        "num_cached_tokens": sum(r.get("num_cached_tokens") or 0 for r in rows),
        "preemptions": int(m["preempt"]),
        "finish_reasons": sorted({r["finish_reason"] for r in rows}),
        "token_ids": token_ids,
    }


def run_peer(model: Path, workload: Path, work: Path, tag: str, a: argparse.Namespace) -> dict:
    out = work / f"peer-{tag}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(a.kv_cache_gib))
    cmd = [str(a.peer_python), str(a.peer_script), "--model", str(model), "--input"]
    cmd += [str(workload), "--dtype", "float32", "--output", str(out)]
    rc, wall, err = _run(cmd, env, work / f"peer-{tag}.log")
    if rc != 0:
        raise RuntimeError(f"bench_e2e.py exited {rc}:\n{err[-3000:]}")
    res = json.loads(out.read_text())
    binding = PEER_THREADS_RE.findall(err)
    return {
        "whole_s": round(wall, 3),
        "gen_s": res["gen_s"],
        "load_s": res["load_s"],
        "output_tokens": res["output_tokens"],
        "output_tok_s": res["output_tok_s"],
        "num_cached_tokens": res.get("num_cached_tokens"),
        "threads_log": ", ".join(binding) or None,
        "impl": res.get("impl"),
        "token_ids": res["token_ids"],
    }


def run_hf(model: Path, workload: Path, work: Path, tag: str, a: argparse.Namespace) -> dict:
    out = work / f"hf-{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--model", str(model)]
    cmd += ["--input", str(workload), "--hf-out", str(out), "--hf-threads", str(a.hf_threads)]
    cmd += ["--hf-batch-size", str(a.hf_batch_size)]
    rc, wall, err = _run(cmd, None, work / f"hf-{tag}.log")
    if rc != 0:
        raise RuntimeError(f"transformers worker exited {rc}:\n{err[-3000:]}")
    res = json.loads(out.read_text())
    return {"whole_s": round(wall, 3), **res}


RUNNERS = {"ours": run_ours, "peer": run_peer, "transformers": run_hf}


def hf_worker(a: argparse.Namespace) -> int:
    """Greedy batched generate with transformers; writes its numbers to --hf-out."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.hf_threads)
    rows = [json.loads(line) for line in a.input.read_text().splitlines() if line.strip()]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = model.config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad
    # ignore_eos: EOS must not stop a row (the others generate past it), so clear it;
    # min_new_tokens would instead forbid EOS and change the argmax.
    model.generation_config.eos_token_id = None
    size = a.hf_batch_size or len(rows)
    token_ids: list[list[int]] = [[] for _ in rows]
    # Rows of one batch must share max_tokens; order by it, then keep input order.
    order = sorted(range(len(rows)), key=lambda i: rows[i].get("max_tokens", 16))
    t1 = time.perf_counter()
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        groups: dict[int, list[int]] = {}
        for i in chunk:
            groups.setdefault(rows[i].get("max_tokens", 16), []).append(i)
        for max_new, idx in groups.items():
            prompts = [rows[i]["prompt_token_ids"] for i in idx]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=None,
                )
            for row, i in enumerate(idx):
                token_ids[i] = out[row, width:].tolist()
    gen_s = time.perf_counter() - t1
    ntok = sum(len(t) for t in token_ids)
    res = {
        "impl": f"transformers {transformers.__version__} generate (greedy, left padding)",
        "gen_s": round(gen_s, 3),
        "load_s": round(load_s, 3),
        "output_tokens": ntok,
        "output_tok_s": round(ntok / gen_s, 2),
        "batch_size": size,
        "threads": torch.get_num_threads(),
        "token_ids": token_ids,
    }
    Path(a.hf_out).write_text(json.dumps(res))
    return 0


# -- comparison ---------------------------------------------------------------------
def agreement(x: list[list[int]], y: list[list[int]]) -> dict[str, Any]:
    """Fraction of requests with identical ids; where they differ, the first position."""
    first_diff = []
    for a_ids, b_ids in zip(x, y):
        if a_ids == b_ids:
            continue
        pos = next(
            (k for k, (s, t) in enumerate(zip(a_ids, b_ids)) if s != t), min(len(a_ids), len(b_ids))
        )
        first_diff.append(pos)
    res: dict[str, Any] = {
        "identical_fraction": round(1 - len(first_diff) / len(x), 4),
        "differing_requests": len(first_diff),
    }
    if first_diff:
        res["first_diff_positions"] = sorted(first_diff)
        res["first_diff_min"] = min(first_diff)
        res["first_diff_median"] = statistics.median(first_diff)
    return res


def ours_threads() -> tuple[str, int]:
    """What our CPU worker uses (OMP_NUM_THREADS when given, else between one core less
    and every core, timed: worker/cpu_threads.py), and the most it uses."""
    if "OMP_NUM_THREADS" in os.environ:
        n = int(os.environ["OMP_NUM_THREADS"])
        return str(n), n
    from worker.cpu_threads import pick_cpu_threads, usable_cores

    low = pick_cpu_threads(1)
    cores = usable_cores()
    if cores < 2:
        return str(low), low
    return f"{low} or {cores}, timed", cores


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds of every engine")
    p.add_argument("--workloads", default="shared,unique")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--no-ttft", action="store_true", help="skip the max_tokens=1 runs")
    # Whole GiB: vLLM reads VLLM_CPU_KVCACHE_SPACE as an int.
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache, ours and peer")
    p.add_argument("--hf-threads", type=int, default=None, help="default: ours' worker threads")
    p.add_argument("--hf-batch-size", type=int, default=0, help="0: all requests in one batch")
    p.add_argument("--seed", type=int, default=20261130)
    p.add_argument("--keep", type=Path, help="keep workloads, outputs and logs in this directory")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    p.add_argument("--peer-script", type=Path, default=PEER_SCRIPT)
    # Internal: the transformers baseline runs in its own process, like the engines.
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--hf-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.engines = [e for e in a.engines.split(",") if e]
    unknown = set(a.engines) - set(ENGINES)
    if unknown and not a.hf_worker:
        p.error(f"unknown engines {sorted(unknown)}")
    return a


def check_peer(a: argparse.Namespace, engines: list[str], result: dict[str, Any]) -> None:
    """Say whether the vLLM peer runs; drop it from `engines` when it is absent."""
    if "peer" in engines and not (a.peer_python.exists() and a.peer_script.exists()):
        engines.remove("peer")
        result["peer_status"] = (
            f"absent: {a.peer_python} or {a.peer_script} missing; "
            f"run bash {PEER_SCRIPTS}/setup-full.sh to compare with vLLM"
        )
        log(result["peer_status"])
    elif "peer" in engines:
        result["peer_status"] = f"ran {a.peer_script} with {a.peer_python}"


def write_workloads(
    work: Path, loads: dict[str, list[dict[str, Any]]], chosen: list[str]
) -> dict[str, dict[str, Path]]:
    """Each chosen workload as JSONL, in full and as its first-token (max_tokens=1) form."""
    files: dict[str, dict[str, Path]] = {}
    for name in chosen:
        files[name] = {"full": work / f"{name}.jsonl", "ttft": work / f"{name}-ttft.jsonl"}
        write_jsonl(files[name]["full"], loads[name])
        write_jsonl(files[name]["ttft"], ttft_rows(loads[name]))
    return files


class Rounds:
    """Every engine on every workload, --repeat times, the engines' order rotating per
    round so that a slow spell of the machine does not always fall on the same one."""

    def __init__(self, engines: list[str], chosen: list[str]) -> None:
        self.chosen = chosen
        self.runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            w: {e: [] for e in engines} for w in chosen
        }
        self.ttft: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in chosen}
        self.failures: list[str] = []

    def _run(self, eng: str, what: str, failed: str, *args: Any) -> dict[str, Any] | None:
        """One engine run; a failure is recorded and logged, and the rounds go on."""
        try:
            return RUNNERS[eng](*args)
        except (RuntimeError, ValueError, OSError) as e:
            self.failures.append(f"{eng} {what}: {e}")
            log(f"{eng} {failed}: {str(e)[-1500:]}")
            return None

    def run_all(
        self,
        a: argparse.Namespace,
        model: Path,
        engines: list[str],
        files: dict[str, dict[str, Path]],
        loads: dict[str, list[dict[str, Any]]],
        work: Path,
    ) -> None:
        for rep in range(a.repeat):
            order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
            for name in self.chosen:
                for eng in order:
                    tag = f"{name}-r{rep}"
                    load = os.getloadavg()[0]
                    log(f"repeat {rep + 1}/{a.repeat} {name}: {eng} (load avg {load:.2f})")
                    r = self._run(eng, tag, "failed", model, files[name]["full"], work, tag, a)
                    if r is None:
                        continue
                    r["load_avg_1m"] = round(os.getloadavg()[0], 2)
                    self.runs[name][eng].append(r)
                    log(
                        f"  {r['output_tokens']} tokens, gen {r['gen_s']:.2f} s = "
                        f"{r['output_tok_s']:.1f} tok/s, whole {r['whole_s']:.1f} s"
                    )
                    if a.no_ttft:
                        continue
                    ttft_file = files[name]["ttft"]
                    t = self._run(
                        eng, f"{tag} ttft", "ttft failed", model, ttft_file, work, f"{tag}-ttft", a
                    )
                    if t is None:
                        continue
                    self.ttft[name][eng].append(t["gen_s"])
                    log(f"  first token of all {len(loads[name])} requests: {t['gen_s']:.2f} s")


def engine_report(rs: list[dict[str, Any]], ttft: list[float]) -> dict[str, Any]:
    """One engine's runs of one workload: medians, first-token times, and the runs."""
    return {
        "median": {k: _median(rs, k) for k in ("output_tok_s", "gen_s", "whole_s", "load_s")},
        "first_token_all_s": ttft or None,
        "first_token_all_s_median": round(statistics.median(ttft), 3) if ttft else None,
        # Greedy on one machine should repeat itself; say when it does not.
        "same_tokens_every_repeat": all(r["token_ids"] == rs[0]["token_ids"] for r in rs),
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs],
    }


def workload_report(
    name: str,
    rows: list[dict[str, Any]],
    engines: list[str],
    rounds: Rounds,
    result: dict[str, Any],
) -> dict[str, Any]:
    """One workload's report: each engine's figures, throughput ratios, token agreement."""
    w: dict[str, Any] = {
        "requests": len(rows),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in rows),
        "max_tokens": rows[0]["max_tokens"],
        "engines": {},
    }
    ids: dict[str, list[list[int]]] = {}
    for eng in engines:
        rs = rounds.runs[name][eng]
        if not rs:
            continue
        ids[eng] = rs[0]["token_ids"]
        w["engines"][eng] = engine_report(rs, rounds.ttft[name][eng])
        if eng == "peer" and rs[0].get("threads_log"):
            result["threads"]["peer"] = rs[0]["threads_log"]
    ratios: dict[str, Any] = {}
    med = {e: w["engines"][e]["median"] for e in w["engines"]}
    for other in ("peer", "transformers"):
        if "ours" in med and other in med:
            ratios[f"ours_over_{other}_output_tok_s"] = round(
                med["ours"]["output_tok_s"] / med[other]["output_tok_s"], 3
            )
            ratios[f"{other}_over_ours_whole_s"] = round(
                med[other]["whole_s"] / med["ours"]["whole_s"], 3
            )
    w["ratios"] = ratios
    pairs = [("ours", "peer"), ("ours", "transformers"), ("peer", "transformers")]
    w["agreement"] = {
        f"{x}_vs_{y}": agreement(ids[x], ids[y]) for x, y in pairs if x in ids and y in ids
    }
    return w


def main() -> int:
    a = parse_args()
    if a.hf_worker:
        return hf_worker(a)

    started = time.perf_counter()
    model = fetch_real_model()
    engines = a.engines
    threads, most = ours_threads()
    if a.hf_threads is None:
        a.hf_threads = most
    result: dict[str, Any] = {
        "bench": "e2e_throughput",
        "model": str(model),
        "repeat": a.repeat,
        "kv_cache_gib": a.kv_cache_gib,
        "cpus": len(os.sched_getaffinity(0)),
        "threads": {"ours": threads, "transformers": a.hf_threads, "peer": None},
    }
    check_peer(a, engines, result)

    work = a.keep or Path(tempfile.mkdtemp(prefix="pagedserve-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = build_workloads(model, a.seed)
    chosen = [w for w in a.workloads.split(",") if w]
    files = write_workloads(work, loads, chosen)
    rounds = Rounds(engines, chosen)
    rounds.run_all(a, model, engines, files, loads, work)
    for name in chosen:
        result[name] = workload_report(name, loads[name], engines, rounds, result)
    if rounds.failures:
        result["failures"] = [f[-2000:] for f in rounds.failures]
    result["files"] = str(work) if a.keep else None
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 1 if rounds.failures else 0


if __name__ == "__main__":
    sys.exit(main())
