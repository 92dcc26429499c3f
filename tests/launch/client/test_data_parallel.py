"""DataParallelLLM with real engine processes: KV-aware routing beats round-robin on a
shared-prefix workload with the same tokens as one engine; a replica that dies fails only
its own requests and comes back; nothing is left behind."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Sequence

import pytest

from launch import SamplingParams
from launch.client.async_llm import AsyncLLM
from launch.client.builtin_model import builtin_model_dir
from launch.client.data_parallel import DataParallelLLM
from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineDeadError
from tests.helpers.cli_helpers import all_gone

BLOCK = 16
PREFIXES = 4
PREFIX_LEN = 96  # six blocks
REQUESTS = 24
MAX_TOKENS = 4
MAX_MODEL_LEN = 160
# Room for about half the prefixes per replica (and one request's tail): where a prefix
# goes decides whether it is still cached when it comes back.
NUM_BLOCKS = 1 + (PREFIXES // 2) * (PREFIX_LEN // BLOCK) + 3
ENGINE = dict(
    device="cpu", block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN
)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _workload(vocab: int) -> list[list[int]]:
    """Requests over a few long prefixes, interleaved, each with its own short tail."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(vocab) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    return [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(4, 20))]
        for _ in range(REQUESTS)
    ]


async def _one(engine: AsyncLLM, prompt: list[int]) -> tuple[list[int], int]:
    """A request's tokens and its prompt tokens served from the prefix cache."""
    tokens: list[int] = []
    cached = 0
    async for out in engine.generate(prompt, GREEDY):
        assert out.error is None, out.error
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


async def _run(engines: Sequence[AsyncLLM], prompts: list[list[int]]) -> tuple[list, float]:
    """Every prompt in order, the i-th to engines[i % len(engines)]: tokens, hit rate."""
    results = [await _one(engines[i % len(engines)], p) for i, p in enumerate(prompts)]
    cached = sum(c for _, c in results)
    return [t for t, _ in results], cached / sum(map(len, prompts))


def _pids(dp: DataParallelLLM) -> list[int]:
    return [p.pid for r in dp.replicas for p in r.llm.engine.procs.values()]


def test_routing_by_cached_prefix_beats_round_robin_with_the_tokens_of_one_engine() -> None:
    async def main() -> dict:
        dp = await DataParallelLLM.create(None, data_parallel_size=2, **ENGINE)
        pids = _pids(dp)
        try:
            prompts = _workload(dp.vocab_size)
            routed_tokens, routed = await _run([dp], prompts)
            decisions = dict(dp.router.decisions)
            dp.reset_prefix_cache()  # both replicas start empty again
            rr_tokens, round_robin = await _run([r.llm for r in dp.replicas], prompts)
        finally:
            await dp.aclose()
        one = await AsyncLLM.create(None, **ENGINE)
        try:
            single_tokens, _ = await _run([one], prompts)
        finally:
            await one.aclose()
        return dict(
            routed=routed, round_robin=round_robin, decisions=decisions, pids=pids,
            tokens=(routed_tokens, rr_tokens, single_tokens),
        )  # fmt: skip

    r = asyncio.run(main())
    print(f"prefix-cache hit rate: routed {r['routed']:.3f}, round-robin {r['round_robin']:.3f}")
    assert r["routed"] >= 1.8 * r["round_robin"], r
    routed_tokens, rr_tokens, single_tokens = r["tokens"]
    assert routed_tokens == single_tokens == rr_tokens
    assert sum(r["decisions"].values()) == REQUESTS
    assert r["decisions"]["prefix_hit"] >= REQUESTS - 2 * PREFIXES, r["decisions"]
    assert all_gone(r["pids"]), "a replica's process outlived aclose()"


@pytest.mark.parametrize(
    ("process", "named"),
    [("engine core", "replica 1 stopped"), ("worker rank 0", "worker rank 0")],
)
def test_a_killed_replica_fails_only_its_requests_and_rejoins_after_a_restart(
    process: str, named: str
) -> None:
    long = SamplingParams(max_tokens=MAX_MODEL_LEN - 8, temperature=0, ignore_eos=True)
    ended: list[tuple[float, str | None]] = []

    async def run(dp: DataParallelLLM, prompt: list[int]) -> None:
        error = None
        try:
            async for out in dp.generate(prompt, long):
                error = out.error or error
        except EngineDeadError as e:
            error = str(e)
        ended.append((asyncio.get_running_loop().time(), error))

    async def main() -> None:
        args = EngineArgs(str(builtin_model_dir()), data_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
        dp = await asyncio.to_thread(DataParallelLLM.from_engine_args, args)
        pids = _pids(dp)
        try:
            # Distinct prompts go by load: two to each replica.
            tasks = [asyncio.create_task(run(dp, [i + 1] * 5)) for i in range(4)]
            await _until(lambda: all(r.llm.num_open_requests == 2 for r in dp.replicas))
            victim = dp.replicas[1]
            old = victim.llm.engine.procs[process].pid
            killed_at = asyncio.get_running_loop().time()
            os.kill(old, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            failed = [(t - killed_at, e) for t, e in ended if e is not None]
            assert len(failed) == 2, ended  # the other replica's two finished
            assert all(named in e and f"pid {old}" in e for _, e in failed), failed
            assert all(t < 10 for t, _ in failed), failed
            # The other replica serves meanwhile.
            assert (await _one(dp, [7] * 9))[0]
            # Serving again with new processes (the old client may not be marked yet).
            await _until(
                lambda: victim.serving and victim.llm.engine.procs[process].pid != old, 120
            )
            pids.extend(_pids(dp))
            # Equal loads and no cached prefix: the two go to different replicas.
            streams = [dp.generate([9] * 9, GREEDY), dp.generate([10] * 9, GREEDY)]
            assert victim.llm.num_open_requests == 1
            for stream in streams:
                async for out in stream:
                    assert out.error is None
        finally:
            await dp.aclose()
        assert all_gone(pids), "a replica's process outlived aclose()"

    asyncio.run(main())


async def _until(condition: object, timeout: float = 60) -> None:
    """Wait for condition() (a generous bound only keeps a broken run from hanging)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_local_replicas_of_several_ranks_on_gpus_are_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ValueError, match="--data-parallel-backend ray"):
        DataParallelLLM(None, data_parallel_size=2, tensor_parallel_size=2)


def test_a_single_engine_refuses_data_parallel_settings() -> None:
    with pytest.raises(ValueError, match="DataParallelLLM"):
        AsyncLLM(None, data_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="tcp://HOST:0"):
        DataParallelLLM(None, data_parallel_size=2, kv_events_endpoint="tcp://127.0.0.1:5555")
