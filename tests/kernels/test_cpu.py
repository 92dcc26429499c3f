"""The CPU kernels (pagedkernels.cpu, with and without the C kernel of pagedkernels.cpu_native)
against the torch reference, their oracle."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagedkernels import cpu, cpu_native, reference
from pagedkernels.selection import KERNELS_ENV, select_kernels
from pagedkernels.testing import random_paged_batch

BLOCK_SIZES = (1, 8, 16, 32)
# Hq / Hkv: one query head per kv head, GQA 2 and 4, and all query heads on one kv head.
HEADS = ((2, 2), (4, 2), (8, 2), (4, 1))
WINDOWS = (None, 1, 3, 7, 10_000)  # 10_000: wider than any sequence here
# Outputs of both paths are float32 results cast to the query dtype: they may differ by
# the float32 rounding, so by one rounding step of the dtype at most.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 2**-14},
    torch.bfloat16: {"rtol": 2**-7, "atol": 2**-14},
}
CACHE_LAYOUTS = ("contiguous", "kv_halves", "kv_per_block", "padded_blocks")
# The library is built with -march=native: its AVX-512 copies exist where the CPU has it.
HAS_AVX512 = " avx512f" in Path("/proc/cpuinfo").read_text()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["native", "gather"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU paths: decode and short extends in the C kernel (the default wherever a C
    compiler exists, as on CI), and everything gathered for torch."""
    native = request.param == "native"
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "1" if native else "0")
    assert (cpu_native.library() is not None) == native, "the C kernel did not build (see the log)"
    return request.param


@dataclass
class Case:
    """One randomly drawn step: a mixed batch and the options of one attention layer."""

    seq_lens: list[int]
    query_lens: list[int]
    block_size: int
    heads: tuple[int, int]
    window: int | None
    soft_cap: float | None
    dtype: torch.dtype
    pad_rows: int
    layout: str


def draw_case(rng: random.Random, dtype: torch.dtype, index: int) -> Case:
    """A batch mixing decode, prefill, extend and empty requests, in random order."""
    seq_lens, query_lens = [], []
    kinds = ["decode", "prefill", "extend", "empty"]
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(kinds)
        if kind == "decode":
            n, s = 1, rng.randint(1, 70)
        elif kind == "prefill":
            n = rng.randint(2, 40)
            s = n
        elif kind == "extend":
            n = rng.randint(2, 20)
            s = n + rng.randint(1, 50)
        else:
            n, s = 0, rng.randint(0, 20)
        seq_lens.append(s)
        query_lens.append(n)
    if sum(query_lens) == 0:  # at least one query row
        seq_lens.append(rng.randint(1, 40))
        query_lens.append(1)
    return Case(
        seq_lens,
        query_lens,
        BLOCK_SIZES[index % len(BLOCK_SIZES)],
        HEADS[index // len(BLOCK_SIZES) % len(HEADS)],
        rng.choice(WINDOWS),
        rng.choice([None, 3.0]),
        dtype,
        rng.choice([0, 0, 3]),
        CACHE_LAYOUTS[index // 16 % len(CACHE_LAYOUTS)],
    )


def strided_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contents as views into one larger buffer, as a worker may allocate them."""
    num_blocks, block_size, heads, dim = key_cache.shape
    page = block_size * heads * dim
    if layout == "contiguous":
        return key_cache, value_cache
    if layout == "kv_halves":  # model_runner: [2, num_blocks, ...], V at an offset
        kv = torch.stack([key_cache, value_cache])
        return kv[0], kv[1]
    if layout == "kv_per_block":  # K and V interleaved per block
        kv = torch.stack([key_cache, value_cache], dim=1)
        return kv[:, 0], kv[:, 1]
    # Blocks 5 elements apart past their page: no row stride fits, the gather falls back.
    buffer = torch.full((2, num_blocks, page + 5), float("nan"), dtype=key_cache.dtype)
    views = buffer[:, :, :page].unflatten(2, (block_size, heads, dim))
    views[0].copy_(key_cache)
    views[1].copy_(value_cache)
    return views[0], views[1]


def run_both(
    case: Case, seed: int, head_dim: int = 16, poison_tails: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = case.heads
    query, key_cache, value_cache, table, qsl, lens = random_paged_batch(
        gen,
        case.seq_lens,
        case.query_lens,
        case.block_size,
        num_kv_heads,
        num_q_heads,
        head_dim,
        case.dtype,
        pad_rows=case.pad_rows,
        released_window=case.window,  # blocks no window reaches point at the NaN block 0
        poison_tails=poison_tails,
    )
    key_cache, value_cache = strided_caches(key_cache, value_cache, case.layout)
    args = (query, key_cache, value_cache, table, qsl, lens, 0.25, case.window, case.soft_cap)
    return cpu.paged_attention(*args), reference.paged_attention(*args), case.pad_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_random_mixed_batches_equal_the_reference(dtype: torch.dtype, path: str) -> None:
    rng = random.Random(str(dtype))
    for index in range(120):
        case = draw_case(rng, dtype, index)
        got, want, pad_rows = run_both(case, seed=index)
        assert got.dtype == dtype, case
        assert torch.isfinite(got).all(), f"read a poisoned or unwritten slot: {case}"
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m, c=case: f"{c}\n{m}")
        if pad_rows:
            assert torch.all(got[-pad_rows:] == 0), case


@pytest.mark.parametrize("window", [1, 5, 16])
def test_released_window_blocks_are_never_read(window: int, path: str) -> None:
    # Long decodes and an extend whose early blocks the scheduler released to block 0.
    case = Case([97, 64, 150], [1, 12, 1], 8, (4, 2), window, None, torch.float32, 0, "contiguous")
    got, want, _ = run_both(case, seed=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_soft_cap_on_a_long_prefill_is_computed_in_query_slices(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # A small logits budget forces several slices through the explicit soft-cap path.
    monkeypatch.setattr(cpu, "LOGITS_ELEMENTS", 4096)
    case = Case([90, 33], [90, 1], 16, (4, 2), None, 2.0, torch.float32, 2, "kv_per_block")
    got, want, _ = run_both(case, seed=1)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [None, 5])
def test_stale_values_past_a_request_s_keys_never_reach_its_output(
    window: int | None, path: str
) -> None:
    # Decode gathers whole blocks: the tail of each request's last block (NaN values, inf
    # keys, as a previous owner may leave) is read but must be masked out, not multiplied
    # by a probability of 0.
    gen = torch.Generator().manual_seed(11)
    lens, queries = [37, 9, 70, 23, 5, 16], [1, 1, 1, 1, 1, 1]
    args = random_paged_batch(gen, lens, queries, 8, 2, 4, 16, torch.float32, poison_tails=True)
    query, key_cache, value_cache, table, qsl, seq_lens = args
    got = cpu.paged_attention(query, key_cache, value_cache, table, qsl, seq_lens, 0.25, window)
    want = reference.paged_attention(
        query, key_cache, value_cache, table, qsl, seq_lens, 0.25, window
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_decode_chunks_split_by_size_give_the_same_result(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # One request per chunk and all in one chunk must agree (chunking is only for speed).
    case = Case([40, 9, 70, 23, 5], [1] * 5, 8, (4, 2), None, None, torch.float32, 0, "contiguous")
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 1)
    small, want, _ = run_both(case, seed=2)
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 1 << 30)
    large, _, _ = run_both(case, seed=2)
    torch.testing.assert_close(small, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(large, want, **TOLERANCE[torch.float32])


def test_a_changed_layout_with_the_same_tensors_is_not_served_a_stale_plan(path: str) -> None:
    gen = torch.Generator().manual_seed(5)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, [30, 12], [1, 1], 8, 2, 4, 16, torch.float32
    )
    cpu.paged_attention(query, kc, vc, table, qsl, lens, 0.25)
    lens.numpy()[0] = 20  # in place, behind torch's back (the worker shares numpy memory)
    table.numpy()[1, :2] = table.numpy()[1, :2][::-1].copy()
    got = cpu.paged_attention(query, kc, vc, table, qsl, lens, 0.25)
    want = reference.paged_attention(query, kc, vc, table, qsl, lens, 0.25)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 24])  # 24: no unrolled copy, d is a variable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_decodes_and_extends_across_softmax_tiles(
    head_dim: int, dtype: torch.dtype, path: str
) -> None:
    # Keys past the C kernel's tile of 256 rescale the running softmax; a window and a soft
    # cap on some; GQA 9/3 as SmolLM2.
    rng = random.Random(head_dim)
    for index in range(6):
        n = 8
        lens = [rng.randint(200, 900) for _ in range(n)]
        queries = [rng.choice([1, 1, 3, 4, 6]) for _ in range(n)]
        window = [None, 300, None, 40, None, 700][index]
        soft_cap = [None, None, 5.0, None, 2.0, None][index]
        case = Case(lens, queries, 16, (9, 3), window, soft_cap, dtype, 1, "kv_per_block")
        got, want, _ = run_both(case, seed=index, head_dim=head_dim)
        assert torch.isfinite(got).all(), case
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m, c=case: f"{c}\n{m}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_prompts_and_decodes_on_the_fast_copies(head_dim: int, path: str) -> None:
    # The C kernel's AVX-512 copies (float32, head size 64 or 128, blocks of a multiple of
    # 16 slots) take prefill chunks of any length: several groups of 64 queries, cached
    # prefixes, windows that start inside a group, 1 to 8 query heads per kv head, and
    # slots past each request's keys that hold NaN and inf. Elsewhere (no AVX-512) the same
    # cases run the generic copies and the gather path.
    rng = random.Random(head_dim)
    heads = [(3, 3), (9, 3), (8, 1), (16, 2), (10, 2), (14, 2)]
    for index in range(12):
        queries = [rng.choice([1, 1, 2, 9, 64, 65, 150]) for _ in range(rng.randint(1, 4))]
        lens = [n + rng.choice([0, 0, 15, 16, 100]) for n in queries]
        window = [None, None, 33, None, 5, 100][index % 6]
        case = Case(
            lens, queries, (16, 32)[index % 2], heads[index % 6], window, None,
            torch.float32, index % 2, CACHE_LAYOUTS[index % 4],
        )  # fmt: skip
        got, want, _ = run_both(case, seed=index, head_dim=head_dim, poison_tails=True)
        assert torch.isfinite(got).all(), case
        # Sums of 64 to 128 products over up to 250 keys: float32 rounding reaches 1e-6.
        tol = {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got, want, **tol, msg=lambda m, c=case: f"{c}\n{m}")


def test_the_c_kernel_shares_torch_s_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # One OpenMP runtime: torch.set_num_threads (the worker's tuner) sizes the C kernel's
    # parallel regions, and no second pool of threads spins beside torch's.
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "1")
    lib = cpu_native.library()
    assert lib is not None, "the C kernel did not build (see the log)"
    for threads in (2, 1):
        torch.set_num_threads(threads)
        assert lib.ps_max_threads() == threads


def test_a_cached_plan_keeps_its_own_copy_of_the_metadata(path: str) -> None:
    # The plan made for tensors A is found again for new tensors B of A's old contents,
    # after A was rewritten in place (the worker reuses its buffers): it must not read A.
    gen = torch.Generator().manual_seed(6)
    query, kc, vc, table, qsl, lens = random_paged_batch(
        gen, [30, 45, 12], [1, 1, 1], 8, 2, 4, 16, torch.float32
    )
    first = (table.clone(), qsl.clone(), lens.clone())
    cpu.paged_attention(query, kc, vc, table, qsl, lens, 0.25)
    table.numpy()[:] = table.numpy()[::-1].copy()
    lens.numpy()[:] = lens.numpy()[::-1].copy()
    got = cpu.paged_attention(query, kc, vc, *first, 0.25)
    want = reference.paged_attention(query, kc, vc, *first, 0.25)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_write_kv_cache_matches_the_reference_and_skips_padding() -> None:
    key, value = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    slots = torch.tensor([13, -1, 2, 7, -1, 19])
    got = strided_caches(torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16), "kv_per_block")
    want = (torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16))
    cpu.write_kv_cache(key, value, *got, slots)
    reference.write_kv_cache(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_auto_selects_the_batched_kernels_on_the_cpu_and_reference_still_selects_the_oracle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu_device = torch.device("cpu")
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert select_kernels(cpu_device, torch.float32, 64).paged_attention is cpu.paged_attention
    monkeypatch.setenv(KERNELS_ENV, "cpu")
    assert select_kernels(cpu_device, torch.bfloat16, 72).paged_attention is cpu.paged_attention
    monkeypatch.setenv(KERNELS_ENV, "reference")
    chosen = select_kernels(cpu_device, torch.float32, 64)
    assert chosen.paged_attention is reference.paged_attention
    monkeypatch.setenv(KERNELS_ENV, "cpu")
    with pytest.raises(ValueError, match="needs the CPU device"):
        select_kernels(torch.device("cuda"), torch.float32, 64)


@pytest.mark.parametrize("heads", [("4", "2", "16"), ("9", "3", "64")])
def test_attention_benchmark_times_the_paths_and_they_agree(heads: tuple[str, ...]) -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_attention_bench.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--heads", *heads, "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["native"] is True
    # SmolLM2's heads take the AVX-512 copies where the CPU has them: timed against the
    # generic copies too.
    fast = heads[2] == "64" and HAS_AVX512
    for row in report["cases"]:
        assert row["native_max_abs_err"] < 1e-5 and row["gather_max_abs_err"] < 1e-5, row
        expected = {"reference/native", "gather/native"} | ({"generic/native"} if fast else set())
        assert set(row["ratios"]) == expected
        if fast:
            assert row["generic_max_abs_err"] < 1e-5, row
