"""Every PAGEDSERVE_* environment variable the project reads, what it does, its default,
and one typed reader each; production code reads the environment only through here.

Worker behaviour travels in WorkerConfig: its fields take these readers as defaults where
the launcher builds the config, so the worker decides by its config, not by its own
environment.

Variable (who reads it; default): what it does.

PAGEDSERVE_ATTENTION (WorkerConfig.attention; auto): the attention kernel family, one of
    AttentionChoice (pagedkernels/selection.py).
PAGEDSERVE_NATIVE_KERNELS (WorkerConfig.native_kernels; 1): 0 never builds or loads the
    CPU C kernel (pagedkernels/cpu_native.py).
PAGEDSERVE_CPU_GEMM (WorkerConfig.cpu_gemm; auto): CPU dense products, one of
    CpuGemmChoice (worker/gemm.py).
PAGEDSERVE_DIST_INIT (worker/parallel.py when WorkerConfig.dist_init is None; none): the
    torch.distributed init method of tensor-parallel ranks started by hand.
PAGEDSERVE_WORKER_HOOKS (WorkerConfig.step_hooks; none): FILE.py:FUNCTION a benchmark
    installs on the worker (worker/step_hooks.py).
PAGEDSERVE_CACHE_DIR (pagedkernels/cpu_native.py; $XDG_CACHE_HOME/pagedserve): where built
    C kernels are cached (a place, not a behaviour).
PAGEDSERVE_CACHE (launch/client/builtin_model.py; ~/.cache/pagedserve): where the
    built-in model is written.
PAGEDSERVE_API_KEY (launch/cli.py; none): `serve --api-key`'s default, kept out of the
    process list.
PAGEDSERVE_PREFIX_CACHE_HASH_SEED (launch/cli_flags.py; none: random at each start): the
    block hashes' secret root, kept out of the process list (the command line takes only
    --prefix-cache-hash-seed-file).
PAGEDSERVE_ZMQ_CURVE_KEYS (launch/cli_flags.py, `--zmq-curve-keys`' default; none): the
    keys directory of the engine's CURVE sockets (protocol/zmq_security.py).
PAGEDSERVE_CHECK_INVARIANTS (launch/client/engine.py; off): 1 makes the core walk the KV
    invariants every step, every few steps on a pool over 16,384 blocks (the walk is
    linear in the pool) (EngineCoreConfig.check_invariants).
PAGEDSERVE_SPIN_US (launch/client/engine.py; per machine): microseconds the core and
    workers poll for a due message before blocking, 0: off (the configs' spin_us).
PAGEDSERVE_BENCH_STEP_DELAY_MS, PAGEDSERVE_BENCH_WORKER_TIMING, PAGEDSERVE_BENCH_SKIP
    (benchmarks/bench_clock.py; off): a benchmark's modelled device, its timing file and
    its forward skips.
PAGEDSERVE_REAL_MODEL_CACHE (tests/helpers/real_model.py, benchmarks; under
    ~/.cache/pagedserve): where a downloaded real model is kept.
PAGEDSERVE_KV_SM_EXAMPLES, PAGEDSERVE_KV_SM_STEPS (tests/enginecore; 150, 50): the KV
    state machine test's size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, cast, get_args

ATTENTION = "PAGEDSERVE_ATTENTION"
NATIVE_KERNELS = "PAGEDSERVE_NATIVE_KERNELS"
CPU_GEMM = "PAGEDSERVE_CPU_GEMM"
DIST_INIT = "PAGEDSERVE_DIST_INIT"
WORKER_HOOKS = "PAGEDSERVE_WORKER_HOOKS"
CACHE_DIR = "PAGEDSERVE_CACHE_DIR"
CACHE = "PAGEDSERVE_CACHE"
API_KEY = "PAGEDSERVE_API_KEY"
PREFIX_CACHE_HASH_SEED = "PAGEDSERVE_PREFIX_CACHE_HASH_SEED"
ZMQ_CURVE_KEYS = "PAGEDSERVE_ZMQ_CURVE_KEYS"
CHECK_INVARIANTS = "PAGEDSERVE_CHECK_INVARIANTS"
SPIN_US = "PAGEDSERVE_SPIN_US"
BENCH_STEP_DELAY_MS = "PAGEDSERVE_BENCH_STEP_DELAY_MS"
BENCH_WORKER_TIMING = "PAGEDSERVE_BENCH_WORKER_TIMING"
BENCH_SKIP = "PAGEDSERVE_BENCH_SKIP"

# auto: the CUDA kernels on a GPU where they support the dtype and head size, the batched
# CPU kernels on the CPU, else the torch reference. cpu: the batched CPU kernels or an
# error. reference: the per-request torch reference anywhere (the oracle). cuda: the CUDA
# kernels or an error. emulated: the CUDA sources on the CPU (very slow; lets the CPU tests
# drive the CUDA kernels through the whole engine).
AttentionChoice = Literal["auto", "cpu", "reference", "cuda", "emulated"]
CpuGemmChoice = Literal["auto", "onednn", "torch"]
BenchSkip = Literal["attention", "layers"]


def _choice(name: str, default: str, choices: object) -> str:
    value = os.environ.get(name, default)
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def attention() -> AttentionChoice:
    return cast(AttentionChoice, _choice(ATTENTION, "auto", AttentionChoice))


def native_kernels() -> bool:
    value = os.environ.get(NATIVE_KERNELS, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{NATIVE_KERNELS} must be 0 or 1, not {value!r}")
    return value == "1"


def cpu_gemm() -> CpuGemmChoice:
    return cast(CpuGemmChoice, _choice(CPU_GEMM, "auto", CpuGemmChoice))


def dist_init() -> str | None:
    return os.environ.get(DIST_INIT) or None


def worker_hooks() -> str | None:
    return os.environ.get(WORKER_HOOKS) or None


def cache_dir() -> str | None:
    return os.environ.get(CACHE_DIR) or None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "pagedserve"))


def api_key() -> str | None:
    return os.environ.get(API_KEY)


def prefix_cache_hash_seed() -> str | None:
    return os.environ.get(PREFIX_CACHE_HASH_SEED) or None


def zmq_curve_keys() -> str | None:
    return os.environ.get(ZMQ_CURVE_KEYS) or None


def check_invariants() -> bool:
    return os.environ.get(CHECK_INVARIANTS) == "1"


def spin_us() -> float | None:
    """SPIN_US as a number (its range is checked with the other engine args)."""
    value = os.environ.get(SPIN_US)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{SPIN_US} must be a number of microseconds, got {value!r}") from None


def bench_step_delay_ms() -> float | None:
    """None when unset; ValueError unless a number >= 0."""
    value = os.environ.get(BENCH_STEP_DELAY_MS)
    if value is None:
        return None
    try:
        delay = float(value or 0)
    except ValueError:
        raise ValueError(
            f"{BENCH_STEP_DELAY_MS} must be a number of milliseconds, got {value!r}"
        ) from None
    if not delay >= 0:
        raise ValueError(f"{BENCH_STEP_DELAY_MS} must be >= 0, got {value!r}")
    return delay


def bench_worker_timing() -> str | None:
    return os.environ.get(BENCH_WORKER_TIMING)


def bench_skip() -> BenchSkip | None:
    value = os.environ.get(BENCH_SKIP, "")
    if value == "":
        return None
    allowed = get_args(BenchSkip)
    if value not in allowed:
        raise ValueError(
            f"{BENCH_SKIP} must be one of {', '.join(allowed)} or empty, got {value!r}"
        )
    return cast(BenchSkip, value)
