"""EngineCore <-> worker messages: the handshake, the per-step delta, sampled tokens.

SchedulerOutput is a delta: new requests carry their prompt, sampling parameters and
full block ids per KV group; running requests carry only what changed. Workers keep the
state the deltas imply (including the tokens they sampled), and the core never resends it.
"""

from __future__ import annotations

import msgspec

from protocol.engine import Logprobs, SamplingDefaults, SamplingParams
from protocol.kv_cache import KVCacheConfig, KVCacheSpec

# Bumped on any change to a message's fields; checked in the handshake.
PROTOCOL_VERSION = 11


class WorkerConnected(msgspec.Struct, frozen=True, tag="connected", array_like=True):
    """Sent on connecting, before the model loads: lets a start-up timeout tell a rank
    that never came from one that came but is still loading or waiting for its group,
    and lets the core refuse a worker started with other settings before it loads."""

    rank: int
    pid: int
    host: str
    protocol_version: int
    world_size: int
    block_size: int


class WorkerAccepted(msgspec.Struct, frozen=True, tag="accepted", array_like=True):
    """The core's answer to WorkerConnected: load the model and join the group."""


class WorkerRejected(msgspec.Struct, frozen=True, tag="rejected", array_like=True):
    """The core's answer to a worker whose settings do not match its own: exit."""

    reason: str


class WorkerHello(msgspec.Struct, frozen=True, tag="hello", array_like=True):
    """A worker's first message: who it is and what KV cache it can hold."""

    protocol_version: int
    rank: int
    world_size: int
    device: str
    kv_cache_specs: dict[str, KVCacheSpec]  # layer name -> spec
    available_kv_memory: int  # bytes
    vocab_size: int
    max_model_len: int  # the model's own limit (max_position_embeddings)
    eos_token_ids: list[int]  # config.json's and generation_config.json's
    sampling_defaults: SamplingDefaults  # from generation_config.json


class WorkerConfigure(
    msgspec.Struct, frozen=True, tag="configure", array_like=True, omit_defaults=True
):
    """The core's answer to every worker: allocate exactly this."""

    kv_cache_config: KVCacheConfig
    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int
    # Blocks the host-memory KV tier holds (each rank its shard of each); 0: no tier.
    kv_tier_slots: int = 0
    # The disk tier's directory (each rank persists its slots there); None: none.
    kv_tier_dir: str | None = None
    kv_tier_dir_slots: int = 0  # slots persisted (--kv-cache-dir-size); 0: all
    # A digest of the block hash function and its seed (never the seed): stored blocks
    # of another deployment's hashes are ignored.
    kv_tier_key: str = ""


class RestoredBlock(msgspec.Struct, frozen=True, array_like=True):
    """A tier slot a worker read back from its disk tier at start-up, verified."""

    slot: int
    block_hash: bytes
    hash_input: bytes


class WorkerReady(msgspec.Struct, frozen=True, tag="ready", array_like=True, omit_defaults=True):
    rank: int
    num_gpu_blocks: int
    kv_tier_restored: list[RestoredBlock] = []


class NewRequestData(msgspec.Struct, frozen=True, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int  # prefix-cache hit


class CachedRequestData(msgspec.Struct, frozen=True, array_like=True):
    """Running requests, as parallel lists (one entry per request)."""

    req_ids: list[str]
    # Newly appended block ids per group, or None when no group got a block. For a
    # request resumed after preemption these are its full tables and replace the old.
    new_block_ids: list[list[list[int]] | None]
    num_computed_tokens: list[int]
    resumed: list[bool]
    # Per group, how many leading blocks are now the null block (a sliding window moved
    # past them and the core freed them), or None when that did not change this step.
    num_skipped_blocks: list[list[int] | None]


class KVTierOps(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A step's KV tier transfers, run before its forward: every store (device block ->
    tier slot), then every load (tier slot -> device block). Parallel lists."""

    store_block_ids: list[int]
    store_slots: list[int]  # distinct within a step
    load_slots: list[int]
    load_block_ids: list[int]  # freshly allocated, distinct
    # With a disk level, parallel to disk_store_slots: each block's hash and hash input,
    # kept beside its bytes so that a restart can rebuild the index. Empty without one.
    store_hashes: list[bytes] = []
    store_inputs: list[bytes] = []
    # The disk level (--kv-cache-dir): device block -> disk slot (written on a thread,
    # after the stores above), and disk slot -> device block, read and verified (the
    # file must hold load_hashes[i] and its checksum) after the host loads.
    disk_store_block_ids: list[int] = []
    disk_store_slots: list[int] = []  # distinct within a step
    disk_load_slots: list[int] = []
    disk_load_block_ids: list[int] = []  # freshly allocated, distinct
    disk_load_hashes: list[bytes] = []


class SchedulerOutput(msgspec.Struct, frozen=True, tag="step", array_like=True, omit_defaults=True):
    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    # Tokens to run this step: new requests first, then cached ones, in list order.
    num_scheduled_tokens: list[int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]  # drop all state
    preempted_req_ids: list[str]  # leave the batch, keep tokens: they will resume
    # Speculative decoding: request id -> draft tokens to verify after its last token
    # (its num_scheduled_tokens counts them). Empty (one byte) without speculation.
    spec_token_ids: dict[str, list[int]] = {}


class TierStep(SchedulerOutput, frozen=True, tag="tier_step", array_like=True):
    """A step that also moves KV tier blocks: its own type, so that every other step's
    frame stays exactly a SchedulerOutput's."""

    # Always given (with_kv_tier); a default only because SchedulerOutput's last fields
    # have theirs.
    kv_tier: KVTierOps = KVTierOps([], [], [], [])


def with_kv_tier(so: SchedulerOutput, ops: KVTierOps | None) -> SchedulerOutput:
    """so, carrying ops when there are any."""
    if ops is None:
        return so
    return TierStep(*msgspec.structs.astuple(so), ops)


def is_answered(so: SchedulerOutput) -> bool:
    """Whether rank 0 answers this step: it runs tokens, or it loads KV tier blocks (a
    two-phase load, enginecore/kv_tier_loads.py: the core waits for the loads' report)."""
    if so.total_num_scheduled_tokens:
        return True
    if so.__class__ is not TierStep:
        return False
    ops = so.kv_tier  # type: ignore[attr-defined]
    return bool(ops.load_block_ids or ops.disk_load_block_ids)


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The logprobs of prompt tokens start, start + 1, ... of one request, computed in
    this step's chunk of its prefill (empty when the chunk holds no token's predecessor:
    a one-token prompt)."""

    req_id: str
    start: int  # >= 1: the first prompt token has no logprob
    logprobs: list[Logprobs]


class PromptEmbedding(msgspec.Struct, frozen=True, array_like=True):
    """A request's embedding (SamplingParams.embedding), float32 little-endian bytes, from
    the step that finished its prompt; rank 0 sends it."""

    req_id: str
    vector: bytes


class ModelRunnerOutput(msgspec.Struct, frozen=True, tag="output", array_like=True):
    """Sampled tokens of the step, for the requests that reached the end of their tokens
    (a request in the middle of a chunked prefill samples nothing)."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    # Empty when no request of the step asked for logprobs (the common case costs one
    # byte); else parallel to req_ids, None for the requests that did not ask.
    logprobs: list[Logprobs | None] = []
    # For each request of the step that asked for prompt_logprobs and prefilled prompt
    # tokens in it.
    prompt_logprobs: list[PromptLogprobs] = []
    embeddings: list[PromptEmbedding] = []
    # Speculative decoding: parallel to req_ids when some request verified drafts, the
    # tokens each accepted after its sampled_token_ids entry (accepted drafts, then the
    # bonus or correcting token); empty (one byte) otherwise.
    spec_token_ids: list[list[int]] = []
    # Parallel to req_ids when some request that asked for logprobs accepted drafts:
    # the logprobs of each of its spec_token_ids; empty (one byte) otherwise.
    spec_logprobs: list[list[Logprobs]] = []


class TierOutput(ModelRunnerOutput, frozen=True, tag="tier_output", array_like=True):
    """A step's answer that also reports on KV tier loads: its own type, so that every
    other answer's frame stays exactly a ModelRunnerOutput's."""

    load_seconds: float = 0.0  # this rank's time in loads since its last report
    # Disk slots whose block a rank could not read or verify: the worker recomputed
    # those blocks in the step instead; the core forgets them.
    failed_disk_slots: list[int] = []


class WorkerFailed(msgspec.Struct, frozen=True, tag="failed", array_like=True):
    rank: int
    error: str


class ShutdownWorker(msgspec.Struct, frozen=True, tag="shutdown", array_like=True):
    pass


class DumpBlockTables(msgspec.Struct, frozen=True, tag="dump_tables", array_like=True):
    """Debugging (replay): every rank answers with its block-table rows, after the steps
    sent before it. The core never sends it while serving."""


class BlockTables(msgspec.Struct, frozen=True, tag="tables", array_like=True):
    """A rank's answer to DumpBlockTables: each request in its batch -> its rows, per KV
    cache group (null block ids where a sliding window skipped)."""

    rank: int
    tables: dict[str, list[list[int]]]


CoreToWorker = (
    WorkerAccepted
    | WorkerRejected
    | WorkerConfigure
    | SchedulerOutput
    | TierStep
    | ShutdownWorker
    | DumpBlockTables
)
WorkerToCore = (
    WorkerConnected
    | WorkerHello
    | WorkerReady
    | ModelRunnerOutput
    | TierOutput
    | WorkerFailed
    | BlockTables
)
