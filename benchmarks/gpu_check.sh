#!/usr/bin/env bash
# GPU check of the CUDA kernels: compile check, GPU tests, the engine end to end in half
# precision, correctness sweep, benchmark, compute-sanitizer (memcheck, racecheck).
#
# On a GPU machine, from the repository root:
#   bash benchmarks/gpu_check.sh [--quick]
# Without a GPU, --emulate runs the same steps with the kernels on the CPU emulator and small
# shapes (the GPU-only tests skip): it checks this script, not the GPU (the tests run it).
# Results (JSON and logs, at most 8 files) go to $OUT if set, else to results/gpu_check/.
# The last line printed is a JSON summary; exit status 1 if anything failed.
#
# The GPU machine may have no network. The kernels need torch and CuPy (cupy-cuda12x or
# cupy-cuda13x); the compile check needs cuda-bindings + nvidia-cuda-nvrtc +
# nvidia-cuda-runtime; the end-to-end step starts the engine, which needs pyzmq and msgspec.
# Whatever is missing there can travel as wheels in .whl/ (ignored by git). Fetch them
# beforehand on a machine with PyPI access:
#   bash benchmarks/gpu_check.sh --fetch-wheels [PY_VERSION=3.12] [extra packages...]
# and carry `.whl` with the working tree; this script installs them into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  shift
  pyver="${PY_VERSION:-3.12}"
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp "${platforms[@]}" -d .whl pyzmq msgspec "$@"
fi

BENCH_FLAGS=()
for arg in "$@"; do
  case "$arg" in
    --quick | --emulate) BENCH_FLAGS+=("$arg") ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--quick] [--emulate] | --fetch-wheels" >&2; exit 2 ;;
  esac
done
RESULTS="${OUT:-results/gpu_check}"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.log "$RESULTS"/*.json  # logs are appended to
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

# Install carried wheels only when something they provide is missing.
if ! "$PY" -c "import cupy, zmq, msgspec" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'EOF'
import importlib
for name in ("torch", "cupy", "cuda.bindings", "zmq", "msgspec", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} MISSING ({exc})")
import torch
print("cuda available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

# Each step logs to $RESULTS/<step>.log, except that the end-to-end tests append to
# pytest.log and both sanitizer tools to sanitizer.log: a small, fixed set of files that
# is quick to bring back from a GPU machine and read.
declare -A status
declare -A log_as=([e2e]=pytest [memcheck]=sanitizer [racecheck]=sanitizer)
run() {  # run NAME CMD...: log the output, remember the exit status
  local name="$1"
  shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$RESULTS/${log_as[$name]:-$name}.log"
  status[$name]=${PIPESTATUS[0]}
  echo "=== $name: exit ${status[$name]} in $((SECONDS - start))s"
}

run nvrtc "$PY" -m pagedkernels.nvrtc_check
run pytest "$PY" -m pytest -q -p no:cacheprovider -k "not emulated" \
  tests/kernels/test_cuda_kernels.py tests/kernels/test_reference.py tests/worker/test_input_batch.py \
  tests/worker/test_kv_cache_memory.py
# The whole engine on the GPU in bf16 and fp16 against float32 transformers.
run e2e "$PY" -m pytest -q -p no:cacheprovider -k "cuda and not emulated" \
  tests/worker/test_half_precision.py
run check "$PY" benchmarks/attention_bench.py check "${BENCH_FLAGS[@]}" --out "$RESULTS/check.json"
run bench "$PY" benchmarks/attention_bench.py bench "${BENCH_FLAGS[@]}" --out "$RESULTS/bench.json"

# compute-sanitizer on the small cases, in what is left of GPU_CHECK_BUDGET_S (default
# 540 s, so the whole check fits in a 10-minute command): memcheck (out-of-bounds and
# misaligned device accesses; without the caching allocator every tensor is its own
# allocation, so a read past a tensor's end is caught, not hidden in a pool), then
# racecheck (shared-memory hazards between threads).
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
sanitize() {  # sanitize TOOL: run it on the small cases if there is time and a sanitizer
  local tool="$1" left=$((BUDGET_S - SECONDS))
  if [[ " ${BENCH_FLAGS[*]} " == *" --emulate "* ]] || ! command -v compute-sanitizer >/dev/null; then
    echo "=== $tool: skipped (no compute-sanitizer, or emulated)"
    status[$tool]=skipped
  elif ((left < 60)); then
    echo "=== $tool: skipped (${left}s left of ${BUDGET_S}s)"
    status[$tool]=skipped
  else
    run "$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$((left - 15))" compute-sanitizer \
      --tool "$tool" --error-exitcode 3 "$PY" benchmarks/attention_bench.py check --small
    [[ "${status[$tool]}" == 124 ]] && status[$tool]=timed-out
  fi
}
sanitize memcheck
sanitize racecheck

# Exit statuses, and the decode targets as the benchmark judged them.
"$PY" - "$RESULTS" "${status[nvrtc]}" "${status[pytest]}" "${status[e2e]}" "${status[check]}" \
  "${status[bench]}" "${status[memcheck]}" "${status[racecheck]}" <<'EOF' | tee "$RESULTS/summary.json"
import json, sys
from pathlib import Path
results = Path(sys.argv[1])
names = ("nvrtc", "pytest", "e2e", "check", "bench", "memcheck", "racecheck")
steps = {n: int(v) if v.isdigit() else v for n, v in zip(names, sys.argv[2:])}
failed = any(isinstance(v, int) and v != 0 for v in steps.values())
summary = {**steps, "failed": int(failed)}
bench = results / "bench.json"
if bench.exists():
    report = json.loads(bench.read_text())
    summary["environment"] = report.get("environment")
    summary["targets"] = report.get("targets")
print(json.dumps(summary))
EOF
failed=0
for name in nvrtc pytest e2e check bench memcheck racecheck; do
  [[ "${status[$name]}" =~ ^[0-9]+$ && "${status[$name]}" != 0 ]] && failed=1
done
exit $failed
