"""protocol/worker.py: every core<->worker message round-trips on its own channel, and a
message of one direction is not read as the other's."""

from __future__ import annotations

import msgspec
import pytest

from protocol.engine import Logprobs, SamplingDefaults, SamplingParams
from protocol.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.worker import (
    PROTOCOL_VERSION,
    BlockTables,
    CachedRequestData,
    CoreToWorker,
    DumpBlockTables,
    ModelRunnerOutput,
    NewRequestData,
    PromptEmbedding,
    PromptLogprobs,
    SchedulerOutput,
    ShutdownWorker,
    WorkerAccepted,
    WorkerConfigure,
    WorkerConnected,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerRejected,
    WorkerToCore,
)

SPEC = FullAttentionSpec(16, 2, 64, "float16")
TO_WORKER = [
    WorkerAccepted(),
    WorkerRejected("block size 16, the core expects 32"),
    WorkerConfigure(KVCacheConfig(8, [KVCacheGroupSpec(["l0"], SPEC)]), 4, 256, 64),
    SchedulerOutput(
        7,
        [NewRequestData("a", [1, 2, 3], SamplingParams(max_tokens=2), [[1]], 0)],
        CachedRequestData(["b"], [[[5]]], [16], [False], [[1]]),
        [3, 1],
        4,
        ["c"],
        ["d"],
    ),
    ShutdownWorker(),
    DumpBlockTables(),
]
TO_CORE = [
    WorkerConnected(0, 123, "host", PROTOCOL_VERSION, 1, 16),
    WorkerHello(
        PROTOCOL_VERSION, 0, 1, "cpu", {"l0": SPEC}, 1 << 20, 100, 2048, [2], SamplingDefaults()
    ),
    WorkerReady(0, 8),
    ModelRunnerOutput(
        7,
        ["a", "b"],
        [9, 10],
        [None, Logprobs(-0.1, [10], [-0.1])],
        [PromptLogprobs("a", 1, [Logprobs(-1.0, [], [])])],
        [PromptEmbedding("a", b"\x00\x00\x80\x3f")],
    ),
    WorkerFailed(0, "out of memory"),
    BlockTables(0, {"a": [[1, 0]]}),
]


@pytest.mark.parametrize(
    ("union", "messages"), [(CoreToWorker, TO_WORKER), (WorkerToCore, TO_CORE)]
)
def test_every_message_round_trips_on_its_channel(union: object, messages: list) -> None:
    for m in messages:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=union) == m


def test_a_message_of_one_direction_is_not_read_as_the_other() -> None:
    step = msgspec.msgpack.encode(TO_WORKER[3])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(step, type=WorkerToCore)
    output = msgspec.msgpack.encode(TO_CORE[3])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(output, type=CoreToWorker)


def test_an_output_without_logprobs_or_extras_sends_empty_lists() -> None:
    plain = ModelRunnerOutput(1, ["a"], [5])
    assert (plain.logprobs, plain.prompt_logprobs, plain.embeddings) == ([], [], [])
    # Array-like on the wire: the tag, then the fields in order.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plain))[:4] == ["output", 1, ["a"], [5]]
