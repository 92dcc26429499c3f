"""enginecore/executor.py, without workers: the block count the engine uses, and where
the core listens for its workers (a bad or taken address is a ConfigError naming it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from enginecore import make_kv_cache_config
from enginecore.errors import ConfigError
from enginecore.executor import MAX_AUTO_NUM_BLOCKS, Executor, size_kv_cache
from launch.client.engine_args import EngineArgs, core_config
from protocol.config import EngineCoreConfig
from protocol.kv_cache import KVCacheSpec
from tests.helpers.kv_helpers import full


def test_block_count_the_engine_uses() -> None:
    specs: dict[str, KVCacheSpec] = {"l0": full(16), "l1": full(16)}
    page = full(16).page_size_bytes
    fits = make_kv_cache_config(specs, available_memory=page * 2 * 100)
    assert size_kv_cache(fits, None) == fits
    chosen = size_kv_cache(fits, 7)
    assert chosen.num_blocks == 7 and chosen.kv_cache_groups == fits.kv_cache_groups
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= 2"):
        size_kv_cache(fits, 1)
    # A toy model on a large GPU: memory for 3x the cap, capped (--num-gpu-blocks still rules).
    huge = make_kv_cache_config(specs, available_memory=page * 2 * 3 * MAX_AUTO_NUM_BLOCKS)
    assert size_kv_cache(huge, None).num_blocks == MAX_AUTO_NUM_BLOCKS
    assert size_kv_cache(huge, 2 * MAX_AUTO_NUM_BLOCKS).num_blocks == 2 * MAX_AUTO_NUM_BLOCKS


def test_a_block_count_beyond_the_core_s_memory_is_a_config_error() -> None:
    fits = make_kv_cache_config({"l0": full(16)}, available_memory=full(16).page_size_bytes * 4)
    # 2**50 blocks of bookkeeping: petabytes, more than any host has.
    with pytest.raises(ConfigError, match=f"{2**50} KV cache blocks need .* --num-gpu-blocks"):
        size_kv_cache(fits, 2**50)


def _config(worker_address: str, world_size: int = 1) -> EngineCoreConfig:
    args = EngineArgs(model="unused", tensor_parallel_size=world_size)
    return core_config(
        args,
        input_address="",
        output_address="",
        worker_address=worker_address,
        log_level="WARNING",
    )


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_the_core_listens_where_the_worker_sockets_are_derived(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/w"
    executor = Executor(ctx, _config(address, world_size=2))
    try:
        assert executor.address == address
        endpoints = [s.last_endpoint.decode() for s in (executor.results, *executor.push)]
        assert endpoints == [f"{address}.results", f"{address}.rank0", f"{address}.rank1"]
    finally:
        executor.shutdown()


def test_port_0_resolves_to_a_bound_run_of_ports(ctx: zmq.Context) -> None:
    executor = Executor(ctx, _config("tcp://127.0.0.1:0", world_size=2))
    try:
        host, port = executor.address.rsplit(":", 1)
        base = int(port)
        assert host == "tcp://127.0.0.1" and base > 0
        assert [s.last_endpoint.decode() for s in executor.push] == [
            f"tcp://127.0.0.1:{base + 1}",
            f"tcp://127.0.0.1:{base + 2}",
        ]
        # The address is taken now: a second core there is refused with a way out.
        with pytest.raises(ConfigError, match=r"cannot listen for workers at .* port 0"):
            Executor(ctx, _config(executor.address, world_size=2))
    finally:
        executor.shutdown()


def test_an_address_of_another_transport_is_a_config_error(ctx: zmq.Context) -> None:
    with pytest.raises(ConfigError, match="'udp://x:1' must start with tcp:// or ipc://"):
        Executor(ctx, _config("udp://x:1"))
