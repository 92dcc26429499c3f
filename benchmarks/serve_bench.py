#!/usr/bin/env python3
"""The OpenAI-compatible server under load, against LLM.generate on the same requests.

    python benchmarks/serve_bench.py [--model M] [--concurrency 1,64] [--repeat 2]
        [--workloads random,shared] [--request-rate R] [--url URL] [--quick]

Clients: the official `openai` client (AsyncOpenAI) on its aiohttp transport
(DefaultAioHttpClient, the `openai[aiohttp]` extra: on this 2-core machine, where the
clients share the CPUs with the server and the engine, its C HTTP parser halves the
clients' CPU per streamed token, 56-62 -> 32 us, against httpx's pure-Python one), one
streaming completion per request, prompts sent as token ids so the server and
LLM.generate see identical ids; greedy, ignore_eos, fixed max_tokens, so every variant
generates the same tokens (checked: the server's ids, from the `return_token_ids`
extension, must equal LLM.generate's). That extension also makes every step's tokens a
chunk, so ITL is per step even when a token ends inside a character. Load: --concurrency
C keeps C streams open (a closed loop: a client sends its next request when one ends);
--request-rate R sends requests at Poisson arrivals of R per second instead (still
capped at C open).

Workloads (prompts are words in the model's tokenizer, cut to a token count):
- random: prompts of random words, no two sharing their first block.
- shared: 4 system prompts, each request one of them plus its own question.

Variants, all in one run: the server (`pagedserve serve`, started here on a free port,
waited for on /health, stopped with SIGTERM) with prefix caching on and then off, and an
in-process LLM with the same setting, up at the same time (an idle engine costs nothing)
so that server and LLM runs of one cell alternate, and a load change on a shared machine
falls on both. LLM.generate runs the requests in waves of C, which is what C closed-loop
clients do when every request generates the same number of tokens. The prefix cache is
reset before every run, so each run starts cold and its hit rate is its own.
Both variants' CPU workers run on the machine's CPUs less one (--worker-threads): the
clients are a load generator, and on the engines' cores they would slow the server's
variant alone.

Reported per run and, per cell (workload, concurrency, prefix caching), the median over
repeats: output and request throughput, TTFT / TPOT / ITL p50, p90, p99 (client side),
the prefix-cache hit rate (the server's /metrics counters before and after; also
cached_tokens / prompt_tokens from `usage`), ratio = server tok/s / LLM.generate tok/s.
The engine's step time: one request at a time through the LLM's engine, the median gap
between its outputs (a decode step) and its first output's latency (prefill), so the
server's TTFT at concurrency 1 reads against it. --url drives a server already running
(its own prefix-cache setting; "server" variant only, the LLM baseline runs locally
on --model). Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from launch.client.async_llm import run as run_async  # noqa: E402
from launch.client.inputs import InputProcessor  # noqa: E402
from protocol.engine import SamplingParams  # noqa: E402

WORDS = [
    "river",
    "stone",
    "lamp",
    "orbit",
    "cedar",
    "maple",
    "signal",
    "harbor",
    "copper",
    "velvet",
    "meadow",
    "canyon",
    "ember",
    "lantern",
    "quartz",
    "prairie",
    "falcon",
    "tundra",
    "glacier",
    "violet",
    "summit",
    "willow",
    "thunder",
    "marble",
    "compass",
    "saddle",
    "timber",
    "beacon",
    "ribbon",
    "pepper",
    "walnut",
    "harvest",
    "jasmine",
    "cobalt",
]
SERVER_LINE = re.compile(r"on (https?://\S+)")


def log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


# -- workloads ----------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]


def _ids(inputs: InputProcessor, rng: random.Random, head: str, n: int) -> list[int]:
    """Token ids of head + random words, exactly n of them."""
    tok = inputs.tokenizer
    assert tok is not None, "the model has no tokenizer: the workloads are built from words"
    text = head
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(max(8, (n - len(ids)) // 2)))
        ids = tok.encode(text, add_special_tokens=False)
    return ids[:n]


def build_workload(name: str, inputs: InputProcessor, n: int, a: argparse.Namespace) -> Workload:
    rng = random.Random(f"{a.seed}-{name}-{n}")
    lo, hi = a.prompt_len
    if name == "random":
        prompts = [_ids(inputs, rng, f"Case {i}:", rng.randint(lo, hi)) for i in range(n)]
        heads = {tuple(p[:16]) for p in prompts}
        # A shared first block would be a prefix-cache hit this workload must not have.
        assert len(heads) == len(prompts), "two random prompts share their first 16 tokens"
        return Workload(name, prompts)
    if name == "shared":
        # Up to 4 system prompts, each shared by at least 4 requests when n allows.
        k = max(1, min(4, n // 4))
        systems = [
            _ids(inputs, rng, f"System {j}: you are helper {j}.", a.system_len) for j in range(k)
        ]
        prompts = [
            systems[i % k] + _ids(inputs, rng, f" Question {i}:", a.question_len) for i in range(n)
        ]
        return Workload(name, prompts)
    raise ValueError(f"unknown workload {name!r} (random, shared)")


def percentiles(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    """p50/p90/p99 (in ms by default); None when there is nothing to measure."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * scale, 3)

    return {"p50": round(statistics.median(s) * scale, 3), "p90": at(0.9), "p99": at(0.99)}


# -- the server -----------------------------------------------------------------------
class ServerProcess:
    """`pagedserve serve` on a free port, in its own process group so the terminal's
    Ctrl-C reaches only us, and we stop it in order (SIGTERM, then SIGKILL)."""

    def __init__(self, a: argparse.Namespace, prefix_caching: bool) -> None:
        # INFO: the CPU worker logs its thread-count choices (reported per run); nothing
        # is logged per step or per request at that level.
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--port", "0", "--log-level", "INFO"]
        if a.profile_server:
            # cProfile writes its file when serve returns (SIGTERM ends it with status 0).
            out = f"{a.profile_server}.{'on' if prefix_caching else 'off'}.prof"
            cmd[1:1] = ["-m", "cProfile", "-o", out]
        cmd += _engine_flags(a, prefix_caching)
        cmd += ["--stream-interval", str(a.stream_interval)]
        if a.model is not None:
            cmd += ["--model", a.model]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._url: str | None = None
        self._seen = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = SERVER_LINE.search(line)
            if m and self._url is None:
                self._url = m.group(1)
                self._seen.set()
        self._seen.set()

    def wait_ready(self, timeout: float) -> str:
        self._seen.wait(timeout)
        if self._url is None:
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self._url}/health", timeout=5) as r,
            ):
                if r.status == 200:
                    return self._url
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("/health never answered 200:\n" + "".join(self.lines[-30:]))
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM (the server stops its engine in order), SIGKILL for the group if that
        takes too long; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("the server did not stop in 30 s: killing its process group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _engine_flags(a: argparse.Namespace, prefix_caching: bool) -> list[str]:
    flags = []
    if a.device:
        flags += ["--device", a.device]
    if a.dtype:
        flags += ["--dtype", a.dtype]
    if not prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def _engine_kwargs(a: argparse.Namespace, prefix_caching: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"enable_prefix_caching": prefix_caching}
    if a.device:
        kw["device"] = a.device
    if a.dtype:
        kw["dtype"] = a.dtype
    return kw


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def server_counters(url: str) -> dict[str, float]:
    """The server's /metrics counters this benchmark reads: prefix-cache queries and
    hits in tokens, and TTFT as the server measures it (from a request's arrival)."""
    from prometheus_client.parser import text_string_to_metric_families

    got = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(_get(f"{url}/metrics").decode()):
        for s in family.samples:
            if s.name in got:
                got[s.name] += s.value
    return got


def reset_server_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


# -- one server run -------------------------------------------------------------------
@dataclass
class Result:
    """One request as a client saw it (times in seconds, from perf_counter)."""

    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def _create_args(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion's arguments. The prompt's token ids ride in extra_body,
    the same JSON on the wire: the SDK's typed transform walks a list of ids one element
    at a time (~3 ms of client CPU per 300-token prompt here, before anything is sent),
    which made up most of the TTFT the client saw over the server's own, and at 64
    streams spread each wave's arrivals over ~200 ms."""
    return {
        "model": model,
        "prompt": "",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"prompt": prompt, "ignore_eos": True, "return_token_ids": True},
    }


class _Clock:
    """Stamps a request's chunks: TTFT, the gaps between chunks with tokens (ITL)."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.start = self.last = time.perf_counter()

    def tokens(self, ids: list[int]) -> None:
        if not ids:
            return
        now = time.perf_counter()
        res = self.res
        if res.ttft is None:
            res.ttft = now - self.start
        else:
            res.itl.append(now - self.last)
        self.last = now
        res.token_ids.extend(ids)


async def _one_typed(client: Any, model: str, prompt: list[int], max_tokens: int) -> Result:
    """The official client as a user calls it: each chunk parsed into its typed objects."""
    res = Result()
    clock = _Clock(res)
    try:
        stream = await client.completions.create(**_create_args(model, prompt, max_tokens))
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                clock.tokens(getattr(choice, "token_ids", None) or [])
                if choice.finish_reason is not None:
                    res.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                res.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as e:  # one failed request is reported, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - clock.start
    return res


_decode = msgspec.json.Decoder()


async def _one_raw(client: Any, model: str, prompt: list[int], max_tokens: int) -> Result:
    """The official client's raw streaming response (its HTTP, retries and errors), the
    events decoded here with msgspec: building typed objects per chunk costs the client
    more CPU than the server spends on it, on the cores the server needs."""
    res = Result()
    clock = _Clock(res)
    try:
        async with client.completions.with_streaming_response.create(
            **_create_args(model, prompt, max_tokens)
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = _decode.decode(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                for choice in chunk["choices"]:
                    clock.tokens(choice.get("token_ids") or [])
                    if choice.get("finish_reason") is not None:
                        res.finish_reason = choice["finish_reason"]
                u = chunk.get("usage")
                if u is not None:
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
    except Exception as e:  # one failed request is reported, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - clock.start
    return res


async def _drive(
    url: str, model: str, prompts: list[list[int]], a: argparse.Namespace, concurrency: int
) -> tuple[list[Result], float]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        max_retries=0,
        timeout=a.request_timeout,
        http_client=openai.DefaultAioHttpClient(timeout=a.request_timeout),
    )
    results: list[Result] = [Result() for _ in prompts]
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(a.seed)

    one = _one_raw if a.client == "raw" else _one_typed

    async def run(i: int) -> None:
        async with gate:
            results[i] = await one(client, model, prompts[i], a.max_tokens)

    start = time.perf_counter()
    try:
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.ensure_future(run(i)))
            if a.request_rate:
                await asyncio.sleep(rng.expovariate(a.request_rate))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return results, time.perf_counter() - start


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) a process has used so far; None without one."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Pids of pid's direct children (a server's engine processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    out.append(int(entry))
    return out


def total_cpu(pids: list[int]) -> float | None:
    times = [cpu_seconds(p) for p in pids]
    return sum(t for t in times if t is not None) if pids else None


def _us_per_token(cpu0: float | None, cpu1: float | None, ntok: int) -> float | None:
    return round((cpu1 - cpu0) / ntok * 1e6, 1) if cpu0 is not None and cpu1 and ntok else None


def server_run(
    url: str,
    model: str,
    w: Workload,
    a: argparse.Namespace,
    concurrency: int,
    pid: int | None = None,
    engine_pids: list[int] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    reset_server_cache(url)
    m0 = server_counters(url)
    s0, c0, e0 = cpu_seconds(pid), time.process_time(), total_cpu(engine_pids or [])
    # The clients' loop on uvloop, as the server's: on two cores the client's CPU per
    # token (~55 us, ~15% less than on asyncio's loop) is taken from the engine's.
    results, seconds = run_async(_drive(url, model, w.prompts, a, concurrency))
    s1, c1, e1 = cpu_seconds(pid), time.process_time(), total_cpu(engine_pids or [])
    m1 = server_counters(url)
    q, h, ttft_s, n = (m1[k] - m0[k] for k in COUNTERS)
    done = [r for r in results if r.error is None and r.finish_reason is not None]
    ntok = sum(len(r.token_ids) for r in results)
    tpot = [
        (r.latency - r.ttft) / (len(r.token_ids) - 1)
        for r in done
        if r.ttft is not None and len(r.token_ids) > 1
    ]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    errors = sorted({r.error for r in results if r.error})
    return {
        "seconds": round(seconds, 3),
        "requests": len(results),
        "finished": len(done),
        "errors": errors[:3],
        "output_tokens": ntok,
        "output_tok_s": round(ntok / seconds, 1),
        "request_s": round(len(done) / seconds, 3),
        # CPU per output token of the server process alone (not its engine), and of
        # this client: less noisy than wall time on a shared machine.
        "server_cpu_us_per_token": _us_per_token(s0, s1, ntok),
        "client_cpu_us_per_token": _us_per_token(c0, c1, ntok),
        "engine_cpu_us_per_token": _us_per_token(e0, e1, ntok),
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in done for x in r.itl]),
        "e2e_ms": percentiles([r.latency for r in done]),
        # The server's own view: arrival to first token, without the client's part.
        "server_ttft_mean_ms": round(ttft_s / n * 1e3, 3) if n else None,
        "prefix_hit_rate": round(h / q, 4) if q else 0.0,
        "cached_token_rate": round(sum(r.cached_tokens for r in results) / prompt_tokens, 4)
        if prompt_tokens
        else 0.0,
    }, [r.token_ids for r in results]


# -- the LLM.generate baseline ----------------------------------------------------------
def llm_run(
    llm: Any, w: Workload, a: argparse.Namespace, concurrency: int
) -> tuple[dict[str, Any], list[list[int]]]:
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    outs = []
    engine_pids = [p.pid for p in llm.engine.procs.values()]
    c0, e0 = time.process_time(), total_cpu(engine_pids)
    start = time.perf_counter()
    for k in range(0, len(w.prompts), concurrency):
        outs += llm.generate(w.prompts[k : k + concurrency], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    c1, e1 = time.process_time(), total_cpu(engine_pids)
    ntok = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in w.prompts)
    return {
        "seconds": round(seconds, 3),
        "requests": len(outs),
        "finished": sum(o.finish_reason == "length" for o in outs),
        "output_tokens": ntok,
        "output_tok_s": round(ntok / seconds, 1),
        "request_s": round(len(outs) / seconds, 3),
        "client_cpu_us_per_token": _us_per_token(c0, c1, ntok),
        "engine_cpu_us_per_token": _us_per_token(e0, e1, ntok),
        "cached_token_rate": round(sum(o.num_cached_tokens for o in outs) / prompt_tokens, 4),
    }, [o.token_ids for o in outs]


def engine_step_time(llm: Any, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    """The engine alone on a low-load run's prompts, one request at a time through the
    LLM's engine (the prefix cache reset once before, as before a server run, so hits
    are the same): its first output's latency (the prefill step, what TTFT at low load
    compares to) and the gaps between its outputs (decode steps), in ms."""
    params = SamplingParams(max_tokens=a.step_probe_tokens, temperature=0, ignore_eos=True)
    engine = llm.engine
    llm.reset_prefix_cache()
    gaps: list[float] = []
    firsts: list[float] = []
    for i, prompt in enumerate(prompts):
        rid = f"step-probe-{i}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, params)
        stamps: list[float] = []
        finished = False
        while not finished:
            batch = engine.get_outputs()
            now = time.perf_counter()
            for o in batch.outputs if batch is not None else ():
                if o.request_id == rid and o.new_token_ids:
                    stamps.append(now)
                finished |= o.request_id == rid and o.finish_reason is not None
        firsts.append(stamps[0] - start)
        gaps += [b - c for c, b in itertools.pairwise(stamps)]
    return {"first_token_ms": percentiles(firsts), "decode_step_ms": percentiles(gaps)}


# -- the run ---------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], *path: str) -> float | None:
    vals = []
    for r in rows:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            vals.append(v)
    return round(statistics.median(vals), 3) if vals else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["concurrency"], r["prefix_caching"]), []).append(r)
    out = []
    for (wl, c, pc), rows in cells.items():
        out.append(
            {
                "workload": wl,
                "concurrency": c,
                "prefix_caching": pc,
                "repeats": len(rows),
                "server_tok_s": _median(rows, "server", "output_tok_s"),
                "llm_tok_s": _median(rows, "llm", "output_tok_s"),
                "ratio": _median(rows, "ratio"),
                "ratios": [r["ratio"] for r in rows],
                "ttft_p50_ms": _median(rows, "server", "ttft_ms", "p50"),
                "server_ttft_mean_ms": _median(rows, "server", "server_ttft_mean_ms"),
                "tpot_p50_ms": _median(rows, "server", "tpot_ms", "p50"),
                "itl_p50_ms": _median(rows, "server", "itl_ms", "p50"),
                "server_cpu_us_per_token": _median(rows, "server", "server_cpu_us_per_token"),
                "client_cpu_us_per_token": _median(rows, "server", "client_cpu_us_per_token"),
                "llm_client_cpu_us_per_token": _median(rows, "llm", "client_cpu_us_per_token"),
                "engine_cpu_us_per_token": _median(rows, "server", "engine_cpu_us_per_token"),
                "llm_engine_cpu_us_per_token": _median(rows, "llm", "engine_cpu_us_per_token"),
                "prefix_hit_rate": _median(rows, "server", "prefix_hit_rate"),
                "engine_first_token_p50_ms": _median(rows, "engine", "first_token_ms", "p50"),
                "engine_decode_step_p50_ms": _median(rows, "engine", "decode_step_ms", "p50"),
            }
        )
    return out


def goals(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two goals: throughput ratio at the highest concurrency (every cell,
    the worst counts), and TTFT at concurrency 1 against the engine's own first token on
    the same prompts (its prefill step; the decode step is reported beside it)."""
    out: dict[str, Any] = {}
    if not summary:
        return out
    top = max(s["concurrency"] for s in summary)
    ratios = [s["ratio"] for s in summary if s["concurrency"] == top and s["ratio"]]
    if ratios:
        out["throughput_concurrency"] = top
        out["throughput_ratio_min"] = min(ratios)
        out["throughput_ratio_median"] = round(statistics.median(ratios), 3)
        out["throughput_met"] = min(ratios) >= 0.9
    low = [
        s for s in summary if s["concurrency"] == 1 and s["engine_first_token_p50_ms"] is not None
    ]
    if low and all(s["ttft_p50_ms"] is not None for s in low):
        over = [round(s["ttft_p50_ms"] - s["engine_first_token_p50_ms"], 3) for s in low]
        out["ttft_over_engine_first_token_ms"] = over
        out["ttft_over_engine_first_token_max_ms"] = max(over)
        out["engine_decode_step_p50_ms"] = round(
            statistics.median(s["engine_decode_step_p50_ms"] for s in low), 3
        )
        out["ttft_met"] = max(over) <= 5.0
    return out


def run_setting(
    a: argparse.Namespace,
    prefix_caching: bool,
    workloads: dict[tuple[str, int], Workload],
    stack: contextlib.ExitStack,
    runs: list[dict[str, Any]],
) -> None:
    """Every cell with prefix caching on or off (the server and an LLM up together)."""
    from launch import LLM

    tag = "on" if prefix_caching else "off"
    server = None
    if a.url is None:
        log(f"prefix caching {tag}: starting the server and the LLM")
        server = ServerProcess(a, prefix_caching)
        stack.callback(server.stop)
    llm = LLM(a.model, **_engine_kwargs(a, prefix_caching))
    stack.callback(llm.close)
    url = a.url or (server.wait_ready(a.startup_timeout) if server else "")
    pid = server.proc.pid if server is not None else None
    engine_pids = children(pid) if pid is not None else []
    model = json.loads(_get(f"{url}/v1/models"))["data"][0]["id"]
    # First runs pay for lazy start-up work (allocator, caches) and for the CPU worker's
    # choice of thread count, probed in the first ~70 steps of a large batch (a server
    # runs long; a cell lasts ~250 steps): one wave at the highest concurrency, not part
    # of any cell, for the server and the LLM alike.
    top = max(c for _, c in workloads)
    warm = next(w for (_, c), w in workloads.items() if c == top)
    warm_up = Workload("warm-up", warm.prompts[:top])
    server_run(url, model, warm_up, a, top)
    llm_run(llm, warm_up, a, top)
    if server is not None:
        for line in server.lines:
            if "CPU threads" in line:
                log(f"prefix caching {tag}, server's worker: {line.strip()}")
    for (name, c), w in workloads.items():
        step = engine_step_time(llm, w.prompts, a) if c == 1 else None
        if step is not None:
            log(f"{name} prefix {tag}: the engine alone, one request at a time: {step}")
        for rep in range(a.repeat):
            order = ("server", "llm") if rep % 2 == 0 else ("llm", "server")
            row: dict[str, Any] = {
                "workload": name,
                "concurrency": c,
                "prefix_caching": tag if a.url is None else "server's",
                "repeat": rep,
            }
            ids: dict[str, list[list[int]]] = {}
            for variant in order:
                if variant == "server":
                    seen = len(server.lines) if server is not None else 0
                    row["server"], ids["server"] = server_run(url, model, w, a, c, pid, engine_pids)
                    if server is not None:
                        # The CPU worker's thread-count switches during the run, if any.
                        row["server"]["worker_threads"] = [
                            line.strip() for line in server.lines[seen:] if "CPU threads" in line
                        ]
                else:
                    row["llm"], ids["llm"] = llm_run(llm, w, a, c)
            if step is not None:
                row["engine"] = step
            row["ratio"] = round(row["server"]["output_tok_s"] / row["llm"]["output_tok_s"], 3)
            row["same_token_ids"] = ids["server"] == ids["llm"]
            s = row["server"]
            log(
                f"{name} c={c} prefix {tag} #{rep}: server {s['output_tok_s']} tok/s, "
                f"LLM {row['llm']['output_tok_s']} tok/s, ratio {row['ratio']}, "
                f"TTFT p50 {s['ttft_ms']['p50']} ms, hit {s['prefix_hit_rate']}, "
                f"finished {s['finished']}/{s['requests']}"
            )
            runs.append(row)
    if server is not None:
        code = server.stop()
        if code != 0:
            raise RuntimeError(f"the server exited {code}:\n" + "".join(server.lines[-30:]))
    llm.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hub id (default: the built-in)")
    p.add_argument("--url", help="drive this running server instead of starting one")
    p.add_argument("--device", help="engine device (default: the engine's)")
    p.add_argument("--dtype", help="engine dtype (default: the engine's)")
    p.add_argument("--workloads", default="random,shared")
    p.add_argument("--concurrency", default="1,64", help="comma-separated open streams")
    p.add_argument(
        "--client",
        choices=("raw", "openai"),
        default="raw",
        help="raw: the openai client's raw stream, events decoded with msgspec; openai: "
        "every chunk parsed into the client's typed objects (costs the client ~4x the CPU)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval (tokens per streamed chunk; default 1, the "
        "goal's setting)",
    )
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    p.add_argument("--requests", type=int, help="requests per cell (default: 2x C, 16 at C=1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", default="100,300", help="random prompts: min,max tokens")
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--prefix-caching", default="on,off", help="settings to run: on,off")
    p.add_argument(
        "--step-probe-tokens", type=int, default=16, help="tokens per engine-alone request"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--worker-threads",
        type=int,
        help="the CPU workers' torch threads, server and LLM alike (OMP_NUM_THREADS); 0: "
        "each worker picks its own count. Default: OMP_NUM_THREADS if set, else the "
        "machine's CPUs less one, so the clients driving the server have a core of their "
        "own in both variants, as they would on another machine (default_worker_threads)",
    )
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument(
        "--profile-server",
        metavar="PREFIX",
        help="run the server under cProfile; stats in PREFIX.on.prof / PREFIX.off.prof",
    )
    p.add_argument("--quick", action="store_true", help="a small run (seconds)")
    a = p.parse_args(argv)
    if a.quick:
        a.concurrency, a.requests, a.max_tokens = "1,4", 4, 8
        a.prompt_len, a.system_len, a.question_len = "20,40", 48, 8
        a.repeat, a.step_probe_tokens = 1, 4
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.prompt_len = tuple(int(x) for x in a.prompt_len.split(","))
    a.workloads = a.workloads.split(",")
    a.prefix_caching = [s == "on" for s in a.prefix_caching.split(",")]
    if a.url is not None:
        a.url = a.url.rstrip("/").removesuffix("/v1")
        a.prefix_caching = [True]  # the server's own setting; only the baseline's is ours
    return a


def default_worker_threads() -> int:
    """The machine's CPUs less one. The clients here are a load generator, as heavy per
    streamed token as the server itself (27-44 us against 26-40 on a 2-core VM); on the
    workers' cores they slow the server's variant alone, and the ratio then prices the
    clients, not the API layer."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker_threads is None:
        # A count the caller fixed in the environment stands, as it does for the engines.
        fixed = os.environ.get("OMP_NUM_THREADS", "")
        a.worker_threads = int(fixed) if fixed.isdigit() else default_worker_threads()
    if a.worker_threads < 0:
        raise SystemExit("--worker-threads must be >= 0 (0: each worker picks its count)")
    if a.worker_threads:
        os.environ["OMP_NUM_THREADS"] = str(a.worker_threads)  # every engine started here
    inputs = InputProcessor.load(a.model)
    workloads = {}
    for name in a.workloads:
        for c in a.concurrency:
            n = a.requests or (16 if c == 1 else 2 * c)
            workloads[name, c] = build_workload(name, inputs, n, a)
    runs: list[dict[str, Any]] = []
    # SIGTERM ends us like Ctrl-C does, so the ExitStack stops what we started.
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    try:
        for pc in a.prefix_caching:
            with contextlib.ExitStack() as stack:
                run_setting(a, pc, workloads, stack, runs)
    except KeyboardInterrupt:
        log("interrupted: everything this run started is stopped")
        return 130
    summary = summarize(runs)
    result = {
        "benchmark": "serve_bench",
        "model": a.model or "builtin",
        "url": a.url,
        "device": a.device or "engine default",
        "cpus": os.cpu_count(),
        "worker_threads": a.worker_threads or "each worker's choice",
        "max_tokens": a.max_tokens,
        "request_rate": a.request_rate,
        "client": a.client,
        "stream_interval": a.stream_interval,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "goals": goals(summary),
        "all_finished": all(
            r["server"]["finished"] == r["server"]["requests"]
            and r["llm"]["finished"] == r["llm"]["requests"]
            for r in runs
        ),
        "same_token_ids": all(r["same_token_ids"] for r in runs),
        "runs": runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
