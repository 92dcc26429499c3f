"""Data-parallel replicas whose workers are Ray actors, on Ray's two-node test cluster: a
placement group per replica, a killed actor fails only its replica's requests naming its
node and rank, the replica comes back on the cluster, nothing is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from launch import SamplingParams
from launch.client.data_parallel import DataParallelLLM
from launch.client.engine_processes import EngineDeadError
from launch.client.ray_executor import RayRank
from tests.helpers.cli_helpers import all_gone
from tests.helpers.ray_cluster import ray_cluster

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ray_cluster(2) as c:
        yield c


def _groups_left() -> list[str]:
    return [pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"]


async def _tokens(dp: DataParallelLLM, prompt: list[int], params: SamplingParams) -> str | None:
    """None once the request finished; else its error."""
    try:
        async for out in dp.generate(prompt, params):
            if out.error is not None:
                return out.error
    except EngineDeadError as e:
        return str(e)
    return None


def test_a_killed_actor_fails_its_replica_only_and_the_replica_returns(cluster: Cluster) -> None:
    async def main() -> None:
        dp = await DataParallelLLM.create(
            None, data_parallel_size=2, data_parallel_backend="ray", device="cpu",
            max_model_len=256, num_gpu_blocks=64,
        )  # fmt: skip
        try:
            ranks = [r.llm.engine.procs["worker rank 0"] for r in dp.replicas]
            assert all(isinstance(r, RayRank) for r in ranks)
            assert len(_groups_left()) == 2  # a placement group per replica
            pids = [r.pid for r in ranks]
            tasks = [asyncio.create_task(_tokens(dp, [i + 1] * 5, LONG)) for i in range(2)]
            while not all(r.llm.num_open_requests for r in dp.replicas):
                await asyncio.sleep(0.05)
            os.kill(pids[1], signal.SIGKILL)
            errors = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert errors[0] is None or errors[1] is None, errors  # the other finished
            (error,) = [e for e in errors if e is not None]
            assert "worker rank 0" in error and "node" in error, error
            assert await _tokens(dp, [5] * 5, SHORT) is None  # served meanwhile
            victim = dp.replicas[1]
            deadline = time.monotonic() + 120
            while not victim.serving:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            pids.append(victim.llm.engine.procs["worker rank 0"].pid)
            results = await asyncio.gather(*(_tokens(dp, [i + 9] * 5, SHORT) for i in range(2)))
            assert results == [None, None]
        finally:
            await dp.aclose()
        assert all_gone(pids, timeout=30)
        assert not _groups_left()

    asyncio.run(main())
    assert ray.is_initialized()  # the test's own connection stays
