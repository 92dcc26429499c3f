"""Tensor parallelism: the process group, its collectives, and how weights split by rank.

The N worker ranks of one engine form one torch.distributed group (NCCL on CUDA, gloo on
CPU); the core is not a member, it only sends every rank the same SchedulerOutput bytes.
The rendezvous address comes from the launcher in the environment variable
`PAGEDSERVE_DIST_INIT` (e.g. `tcp://127.0.0.1:29500`).

How a Llama-family decoder splits over tp ranks:
- attention: each rank owns num_heads / tp query heads and the KV heads those query heads
  read. When tp divides num_kv_heads, KV heads split evenly; when num_kv_heads divides
  tp, each rank holds one KV head, replicated on the tp / num_kv_heads ranks that share
  it. q/k/v are column-parallel (output rows by head), o_proj row-parallel.
- MLP: gate/up column-parallel, down row-parallel, intermediate_size split evenly.
- A row-parallel projection produces a partial sum on each rank; one all-reduce restores
  the full hidden state, and its bias is added once, after the reduce.
- vocabulary: the embedding and LM head hold ceil(vocab / tp) rows each (the last rank's
  tail is zero padding). The embedding zeroes rows outside its slice and all-reduces;
  the LM head's vocab slices of logits are all-gathered and the padding cut off, so
  padded entries can never be sampled.
Everything else (norms, rotary) is replicated. With tp == 1 no collective runs and every
layer is the plain single-device computation.

Sampling: every rank ends the forward with the same full logits (an all-gather hands all
ranks identical bytes, and everything after a collective is computed identically), runs
the same sampler with generators seeded the same way (WorkerConfig.seed, identical on all
ranks, for torch's global and the runner's shared generator; SamplingParams.seed for a
request's own) and draws from them in the same order, because every rank applies the
same SchedulerOutputs. So all ranks sample the same tokens and append them to their own
persistent batch without any extra communication; only rank 0 returns ModelRunnerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol import envs

DIST_INIT_ENV = envs.DIST_INIT
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TPContext:
    """This rank's place in the tensor-parallel group; passed explicitly to every layer
    that shards or communicates, so a model built without it is the single-device one."""

    rank: int = 0
    size: int = 1
    # None: the default (world) group, which is the TP group while workers run TP only.
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def dist_init_method_from_env() -> str:
    method = envs.dist_init()
    if not method:
        raise ValueError(
            f"tensor parallelism needs a rendezvous address: the launcher must set "
            f"{DIST_INIT_ENV} (e.g. tcp://127.0.0.1:29500) for every worker rank"
        )
    return method


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> TPContext:
    """Join the workers' process group (blocks until all world_size ranks arrive).

    The timeout also bounds every later collective, so a dead peer turns into an error
    instead of a hang.
    """
    if world_size == 1:
        return TPContext()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    kwargs: dict[str, object] = {}
    if device.type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(device)
        # Binds the communicator to this rank's GPU now rather than guessing at first use.
        kwargs["device_id"] = device
    else:
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,  # type: ignore[arg-type]
    )
    return TPContext(rank, world_size)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- how tensors split ----------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """The part [start, start + size) of a dimension of length `full` that a rank holds.

    start + size may run past `full` (vocabulary padding): those rows are zero."""

    start: int
    size: int
    full: int

    def scaled(self, factor: int) -> Shard:
        """The same shard in finer units (heads -> rows of head_dim each)."""
        return Shard(self.start * factor, self.size * factor, self.full * factor)


def even_shard(full: int, tp: TPContext, what: str) -> Shard:
    if full % tp.size != 0:
        raise ValueError(
            f"{what} ({full}) is not divisible by the tensor-parallel size ({tp.size})"
        )
    size = full // tp.size
    return Shard(tp.rank * size, size, full)


@dataclass(frozen=True)
class HeadShard:
    q_heads: Shard
    kv_heads: Shard


def shard_heads(num_heads: int, num_kv_heads: int, tp: TPContext) -> HeadShard:
    """This rank's query heads and the KV heads they read (replicated when tp > kv heads)."""
    q_heads = even_shard(num_heads, tp, "num_attention_heads")
    if num_kv_heads % tp.size == 0:
        return HeadShard(q_heads, even_shard(num_kv_heads, tp, "num_key_value_heads"))
    if tp.size % num_kv_heads != 0:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and the tensor-parallel size ({tp.size}) "
            f"must divide one another (KV heads are split evenly, or replicated when there "
            f"are fewer than ranks)"
        )
    # Consecutive ranks share a KV head; their query heads all fall in its group because
    # num_heads / tp divides the group size num_heads / num_kv_heads.
    ranks_per_kv_head = tp.size // num_kv_heads
    return HeadShard(q_heads, Shard(tp.rank // ranks_per_kv_head, 1, num_kv_heads))


def shard_vocab(vocab_size: int, tp: TPContext) -> Shard:
    """Equal slices of the vocabulary padded up to a multiple of tp."""
    size = -(-vocab_size // tp.size)
    return Shard(tp.rank * size, size, vocab_size)


# ---- weight loading ---------------------------------------------------------------------


def mark_sharded(param: torch.nn.Parameter, dim: int, shard: Shard) -> None:
    """Record that param holds `shard` of dimension `dim` of the checkpoint tensor."""
    param.tp_split = (dim, shard)  # type: ignore[attr-defined]


def load_shard(param: torch.nn.Parameter, name: str, tensor: torch.Tensor) -> None:
    """Copy this rank's part of the full checkpoint tensor into param."""
    split: tuple[int, Shard] | None = getattr(param, "tp_split", None)
    expected = list(param.shape)
    if split is not None:
        dim, shard = split
        expected[dim] = shard.full
    if list(tensor.shape) != expected:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
        )
    if split is None:
        param.data.copy_(tensor)
        return
    dim, shard = split
    present = max(0, min(shard.size, shard.full - shard.start))
    if present:
        param.data.narrow(dim, 0, present).copy_(tensor.narrow(dim, shard.start, present))
    if present < shard.size:
        param.data.narrow(dim, present, shard.size - present).zero_()
