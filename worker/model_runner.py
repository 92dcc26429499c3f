"""ModelRunner: the model, its paged KV cache, the persistent batch and the sampler.

Each step: apply the SchedulerOutput delta to the batch, build flat inputs (numpy),
commit block tables, run the model over the paged KV cache, sample, remember the
sampled tokens (the core never resends them).

A step is three calls, so the worker can overlap a step's host work with its
predecessor's device work: plan (apply + prepare, host only), launch (queue forward and
sampling, reserve each sampler's next token slot) and collect (wait for the tokens, fill
the slots, answer). The worker plans step N+1 between launching and collecting step N
when N+1 has already arrived (async scheduling); N+1's token ids are then gathered at its
launch, once N's tokens are in. execute() is the three in a row.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.config import WorkerConfig, available_host_memory
from protocol.engine import GREEDY_TEMPERATURE, Logprobs
from protocol.kv_cache import NULL_BLOCK_ID, KVCacheConfig, KVCacheSpec
from protocol.worker import (
    ModelRunnerOutput,
    PromptEmbedding,
    PromptLogprobs,
    SchedulerOutput,
    WorkerConfigure,
)
from worker import bench_clock
from worker.attention import AttentionMetadata
from worker.bench_clock import DeviceClock
from worker.cpu_threads import CpuThreadTuner, pick_cpu_threads
from worker.gemm import use_onednn
from worker.generation_config import load_generation_config
from worker.input_batch import InputBatch
from worker.layers import Linear, ParallelLMHead
from worker.model_config import load_model_config
from worker.model_inputs import ModelInputs, prepare_inputs
from worker.models import get_model_class
from worker.parallel import TPContext, dist_init_method_from_env, init_distributed
from worker.sampler import (
    PenaltyTensors,
    SamplingTensors,
    compute_logprobs,
    logit_bias_tensors,
    sample,
    token_bans,
)
from worker.staging import StepBuffers
from worker.structured_output import GrammarMatchers
from worker.weights import iterate_weights

log = logging.getLogger("pagedserve.worker")

# CPU workers get an explicit KV budget (there is no device memory to profile).
DEFAULT_CPU_KV_CACHE_MEMORY = 256 << 20
# Prompt positions whose logits are taken at once for prompt_logprobs: a chunk of a long
# prompt would otherwise hold [chunk, vocab] float32 logits (8192 x 150k: 4.9 GB).
PROMPT_LOGPROBS_SLICE = 512
# Kept free beyond the profiled step: decode steps' split-K scratch (a prefill profile
# allocates none; kernels.cuda_kernels bounds it at 512 MiB) and allocator fragmentation.
GPU_STEP_MARGIN_BYTES = 768 << 20
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA device is available")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU: float32 (half precision is slow and imprecise there); GPU: bfloat16.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _TORCH_DTYPES[name]


@dataclass
class StepInputs:
    """Everything a step needs on the device, prepared on the host."""

    step_id: int
    # None until every token is known (a step planned while its predecessor ran).
    input_ids: torch.Tensor | None
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]
    sampling_rows: np.ndarray
    sampling: SamplingTensors
    generators: list[torch.Generator | None]
    # The host inputs, kept until the token ids are gathered and uploaded.
    inputs: ModelInputs | None = None
    # Sampler positions of the requests that asked for logprobs (rank 0 only; None when
    # none did) and how many top alternatives each wants.
    logprob_rows: torch.Tensor | None = None
    logprob_counts: list[int] = field(default_factory=list)
    # Filled by collect: parallel to sampling_req_ids, or empty when nobody asked.
    logprobs: list[Logprobs | None] = field(default_factory=list)
    # Requests that asked for prompt_logprobs and prefill prompt tokens in this step;
    # their logprobs are computed at launch (rank 0 keeps them).
    prompt_plan: list[PromptPlan] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Sampler positions of the requests whose embedding this step yields (their prompt
    # ends here; rank 0 only), else None.
    embed_rows: np.ndarray | None = None


@dataclass
class PromptPlan:
    """One request's prompt tokens whose logprobs this step's chunk yields: tokens
    start .. start + count - 1, each predicted by the hidden state before it, which sits
    at flat_start + j in the step's tokens."""

    req_id: str
    start: int
    flat_start: int
    targets: np.ndarray  # [count] the prompt tokens themselves
    num_top: int


@dataclass
class InFlight:
    """A launched step whose tokens the device is still producing."""

    step: StepInputs
    tokens: torch.Tensor | None  # [K] on the device; None when no request samples
    logits: torch.Tensor | None  # kept for the logprobs, when some request asked
    done: torch.cuda.Event | None  # recorded after the step's work on a GPU
    # The batch's row_changes at launch: while equal, the sampling rows are where they were.
    rows_at_launch: int = 0
    # The final hidden states of step.embed_rows, when some request asked.
    embed_hidden: torch.Tensor | None = None


def gpu_kv_budget(
    *,
    total: int,
    free_at_start: int,
    free_now: int,
    step_peak: int,
    utilization: float,
    where: str,
    margin: int = GPU_STEP_MARGIN_BYTES,
) -> tuple[int, str]:
    """A GPU worker's KV-cache bytes, and how they were found (for the log).

    The worker may hold `utilization` of the device's memory (vLLM's per-instance rule: two
    engines at 0.45 share a GPU). What it took since it started (weights, buffers) and the
    peak of the largest step come out of that share, and a margin is kept; what other
    processes hold is not charged to it, but the budget must also fit in what is free
    now. ValueError, with the numbers, when nothing is left.
    """
    gib = 1 << 30
    taken = max(free_at_start - free_now, 0)
    share = int(utilization * total)
    budget = share - taken - step_peak - margin
    summary = (
        f"{utilization:.0%} of {total / gib:.1f} GiB is {share / gib:.2f} GiB; the model "
        f"and buffers take {taken / gib:.2f} GiB, a step of the largest size peaks at "
        f"{step_peak / gib:.2f} GiB, {margin / gib:.2f} GiB margin"
    )
    if budget <= 0:
        raise ValueError(
            f"{where}: no memory left for a KV cache ({summary}); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, raise "
            "--tensor-parallel-size or use a smaller model"
        )
    fits = free_now - step_peak - margin
    if budget > fits:
        others = max(total - free_at_start, 0)
        raise ValueError(
            f"{where}: a KV cache of {budget / gib:.2f} GiB ({summary}) does not fit in the "
            f"{max(fits, 0) / gib:.2f} GiB free beside the step's peak and margin: other "
            f"processes held {others / gib:.2f} GiB when this worker started; lower "
            "--gpu-memory-utilization or free the device"
        )
    return budget, summary


class ModelRunner:
    # Built by initialize() (WorkerConfigure): the persistent batch and step buffers.
    batch: InputBatch
    buffers: StepBuffers

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        if config.world_size > 1 and self.device.type == "cuda" and self.device.index is None:
            # One GPU per rank; modulo so a launcher that narrows CUDA_VISIBLE_DEVICES to
            # one GPU per process gets cuda:0 everywhere.
            self.device = torch.device("cuda", config.rank % torch.cuda.device_count())
        # Free device memory before this worker loads anything: what the worker takes
        # later is measured from here, so other processes' memory is not charged to its
        # --gpu-memory-utilization share.
        self._free_at_start = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        )
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(pick_cpu_threads(config.world_size))
        # Set by the worker process (worker/cpu_threads.py); a runner used in-process
        # keeps its thread count.
        self.cpu_threads: CpuThreadTuner | None = None
        self.dtype = pick_dtype(config.dtype, self.device)
        # Same seed on every rank: ranks sample identical tokens (see worker.parallel).
        torch.manual_seed(config.seed)
        # Config errors surface before the rendezvous, which would wait for all ranks.
        self.model_config = load_model_config(config.model)
        # What min_tokens keeps from being sampled early (the core stops on the same ids).
        extra_eos = load_generation_config(config.model, config.generation_config)[0]
        self.eos_token_ids = tuple(dict.fromkeys((*self.model_config.eos_token_ids, *extra_eos)))
        self.tp = TPContext()
        if config.world_size > 1:
            self.tp = init_distributed(
                config.rank,
                config.world_size,
                config.dist_init or dist_init_method_from_env(),
                self.device,
            )
        cls = get_model_class(self.model_config.architecture)
        self.model = cls(self.model_config, self.dtype, self.device, self.tp)
        self.model.load_weights(iterate_weights(config.model))
        self.model.eval()
        self.cpu_gemm = "onednn" if use_onednn(self.device, self.dtype) else "torch"
        if self.cpu_gemm == "onednn":
            for module in self.model.modules():
                if isinstance(module, (Linear, ParallelLMHead)):
                    module.pack_weight()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generators: dict[str, torch.Generator] = {}
        # Requests whose output must stay inside a language (structured outputs).
        self.grammars = GrammarMatchers(config.model, self.eos_token_ids)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._in_flight: InFlight | None = None  # launched, not yet collected
        self.clock = DeviceClock.from_env()  # benchmarks only
        skipped = bench_clock.skip_requested()  # benchmarks only
        if skipped is not None:
            bench_clock.skip(skipped, self.model.model.layers)
        kernels = {layer.kernels.name for layer in self.model.attention_layers().values()}
        # Logged at warning level so it shows at the default level: which kernels run
        # decides both speed and numerics.
        log.warning(
            "rank %d: %s on %s in %s; attention kernels: %s%s",
            config.rank,
            self.model_config.architecture,
            self.device,
            self.dtype,
            ", ".join(sorted(kernels)),
            "; products: oneDNN" if self.cpu_gemm == "onednn" else "",
        )

    # -- start-up ---------------------------------------------------------------------
    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        kv_dtype = str(self.dtype).removeprefix("torch.")
        return self.model.kv_cache_specs(self.config.block_size, kv_dtype)

    def available_kv_memory(self) -> int:
        """Bytes this worker can give its KV cache: --kv-cache-memory when set; on a GPU,
        what its --gpu-memory-utilization share of the device leaves after the memory it
        took (weights, buffers) and the peak of the largest step (gpu_kv_budget)."""
        if self.config.kv_cache_memory is not None:
            self._check_fits(self.config.kv_cache_memory, "--kv-cache-memory")
            return self.config.kv_cache_memory
        if self.device.type == "cpu":
            self._check_fits(DEFAULT_CPU_KV_CACHE_MEMORY, "the default CPU KV cache")
            return DEFAULT_CPU_KV_CACHE_MEMORY
        step_peak = self.profile_step(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        where = f"rank {self.config.rank} on {self.device}"
        budget, summary = gpu_kv_budget(
            total=total,
            free_at_start=self._free_at_start,
            free_now=free,
            step_peak=step_peak,
            utilization=self.config.gpu_memory_utilization,
            where=where,
        )
        log.info("%s: KV cache budget %.2f GiB (%s)", where, budget / (1 << 30), summary)
        return budget

    def _allocate_kv_caches(
        self, config: KVCacheConfig, specs: dict[str, KVCacheSpec]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One buffer per KVCacheTensor, exactly its size: what the core budgeted. Every
        layer sharing a buffer views all of it as [2, num_blocks, block_size, heads,
        head_dim] (K then V, each contiguous); a block id belongs to one group at a time,
        so layers of different groups never touch the same block."""
        total = sum(t.size for t in config.kv_cache_tensors)
        self._check_fits(total, f"a KV cache of {config.num_blocks} blocks")
        caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for tensor in config.kv_cache_tensors:
            buffer = torch.zeros(tensor.size, dtype=torch.uint8, device=self.device)
            for name in tensor.shared_by:
                spec = specs.get(name)
                if spec is None or name in caches:
                    raise ValueError(f"KV cache tensor names layer {name!r} twice or not at all")
                if tensor.size != spec.page_size_bytes * config.num_blocks:
                    raise ValueError(
                        f"KV cache tensor of {tensor.size} bytes for layer {name!r}: its spec "
                        f"needs {spec.page_size_bytes} x {config.num_blocks} blocks"
                    )
                shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
                kv = buffer.view(self.dtype).view(shape)
                caches[name] = (kv[0], kv[1])
        # The null block stands in for positions a sliding window has left; no kernel may
        # read it. NaN there turns a kernel that does (even under a mask: 0 * NaN is NaN)
        # into garbage tokens that every equality test sees, instead of a silent read.
        for key_cache, value_cache in caches.values():
            key_cache[NULL_BLOCK_ID].fill_(float("nan"))
            value_cache[NULL_BLOCK_ID].fill_(float("nan"))
        return caches

    def kv_cache_storage_bytes(self) -> tuple[int, int]:
        """(bytes, buffers) of KV storage really allocated: distinct storages behind every
        layer's K and V views, counted from the tensors themselves."""
        storages: dict[int, int] = {}
        for pair in self.kv_caches:
            for cache in pair:
                storage = cache.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()), len(storages)

    def _check_fits(self, nbytes: int, what: str) -> None:
        """ValueError with numbers if nbytes cannot be allocated here now: better than an
        out-of-memory kill a minute into start-up."""
        if self.device.type == "cuda":
            available, where = torch.cuda.mem_get_info(self.device)[0], f"free on {self.device}"
        else:
            available, where = available_host_memory(), "available host memory"
        if available is not None and nbytes > available:
            gib = 1 << 30
            raise ValueError(
                f"rank {self.config.rank}: {what} needs {nbytes / gib:.2f} GiB but only "
                f"{available / gib:.2f} GiB is {where}: lower --kv-cache-memory or "
                "--num-gpu-blocks"
            )

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, num_seqs: int) -> int:
        """Run the largest step the core may schedule and return its peak allocation on a
        GPU (0 on the CPU, where the run only proves the path): num_tokens tokens of
        prefill (requests no longer than the model's context) into a scratch KV cache,
        then top-k/top-p sampling of num_seqs rows. All ranks run it together (TP
        layers all-reduce)."""
        max_len = self.model_config.max_position_embeddings
        lens = np.full(num_tokens // max_len, max_len, dtype=np.int64)
        if num_tokens % max_len:
            lens = np.append(lens, num_tokens % max_len)
        bs = self.config.block_size
        blocks = -(-lens // bs)
        first_block = 1 + np.concatenate(([0], np.cumsum(blocks)[:-1]))  # 0: the null block
        table = np.zeros((len(lens), int(blocks.max())), dtype=np.int32)
        for i, (start, n) in enumerate(zip(first_block, blocks)):
            table[i, :n] = np.arange(start, start + n)
        req = np.repeat(np.arange(len(lens)), lens)
        pos = np.arange(num_tokens) - np.repeat(np.cumsum(lens) - lens, lens)
        slots = first_block[req] * bs + pos
        layers = self.model.attention_layers().values()
        num_blocks = int(first_block[-1] + blocks[-1])
        scratch = [
            tuple(
                torch.zeros(
                    (num_blocks, bs, layer.num_kv_heads, layer.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
                for _ in range(2)
            )
            for layer in layers
        ]
        device = self.device
        groups = 1 + max(layer.kv_group for layer in layers)
        attn = AttentionMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], np.cumsum(lens)))).to(
                device, torch.int32
            ),
            seq_lens=torch.from_numpy(lens).to(device, torch.int32),
            block_tables=[torch.from_numpy(table).to(device)] * groups,
            slot_mappings=[torch.from_numpy(slots).to(device)] * groups,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.from_numpy(pos).to(device)
        rows = torch.arange(num_seqs, device=device) % num_tokens
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        hidden = self.model(input_ids, positions, attn, scratch)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        sampling = SamplingTensors.from_arrays(
            np.ones(num_seqs, dtype=np.float32),
            np.full(num_seqs, 50, dtype=np.int64),
            np.full(num_seqs, 0.9, dtype=np.float32),
            device,
        )
        generator = torch.Generator(device=device).manual_seed(0)  # leaves the seeds alone
        sample(logits, sampling, [None] * num_seqs, generator)
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    def _configured(self, what: str) -> InputBatch:
        """The batch; ValueError (the worker reports it) if the core skipped configure."""
        if not hasattr(self, "batch"):
            raise ValueError(f"{what} before WorkerConfigure")
        return self.batch

    def initialize(self, msg: WorkerConfigure) -> None:
        """Allocate exactly the core's KV cache config and the persistent batch."""
        config = msg.kv_cache_config
        layers = self.model.attention_layers()
        block_sizes = []
        specs: dict[str, KVCacheSpec] = {}
        for group_id, group in enumerate(config.kv_cache_groups):
            block_sizes.append(group.kv_cache_spec.block_size)
            for name in group.layer_names:
                if name not in layers:
                    raise ValueError(f"KV cache config names unknown layer {name!r}")
                layers[name].kv_group = group_id
                specs[name] = group.kv_cache_spec
        caches = self._allocate_kv_caches(config, specs)
        missing = sorted(set(layers) - set(caches))
        if missing:
            raise ValueError(f"KV cache config leaves layers without a cache: {missing}")
        self.kv_caches = [caches[name] for name in layers]
        # One extra column: a request's last sampled token lands at position max_model_len.
        self.batch = InputBatch(msg.max_num_reqs, msg.max_model_len + 1, block_sizes, self.device)
        self.buffers = StepBuffers(
            msg.max_num_batched_tokens, msg.max_num_reqs, len(block_sizes), self.device
        )

    def block_tables(self) -> dict[str, list[list[int]]]:
        """Debugging (replay): each request in the batch -> its block-table rows per group."""
        batch = self._configured("DumpBlockTables")
        return {req_id: batch.block_ids_of(req_id) for req_id in batch.req_ids}

    # -- steps ------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the delta; run the step if it schedules tokens; remember what it sampled."""
        step = self.plan(so)
        if step is None:
            return None
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def plan(self, so: SchedulerOutput) -> StepInputs | None:
        """The host side of a step: apply the delta and prepare its inputs (None: it
        schedules no tokens). While a step is in flight (the worker plans its successor
        before that step's tokens are known) only a step that can_plan_ahead may come here."""
        batch = self._configured("SchedulerOutput")
        grammars = self.grammars
        for rid in so.finished_req_ids:
            self.generators.pop(rid, None)
            if grammars:
                grammars.drop(rid)
        batch.apply(so)
        for r in so.new_reqs:
            if r.sampling_params.structured_outputs is not None:
                grammars.add(r.req_id, r.sampling_params.structured_outputs)
        if so.total_num_scheduled_tokens == 0:
            return None
        if self.clock is not None:
            self.clock.planning()
        return self.prepare_step(so)

    @staticmethod
    def can_plan_ahead(so: SchedulerOutput) -> bool:
        """Whether `so` can be planned while the previous step's tokens are unknown: not
        when it preempts or resumes a request (its last token may be on its way), nor
        when it reuses the id of a request it finishes (that token would go to the new
        one). Rare; such a step waits for them."""
        if so.preempted_req_ids or any(so.cached_reqs.resumed):
            return False
        if so.finished_req_ids and so.new_reqs:
            finished = set(so.finished_req_ids)
            return not any(r.req_id in finished for r in so.new_reqs)
        return True

    def prepare_step(self, so: SchedulerOutput) -> StepInputs:
        """The host side of a step (after batch.apply): flat inputs, committed block
        tables and sampling tensors, all on the device. With a step in flight the token
        ids, and the sampling extras that read tokens (penalties), wait for launch()."""
        batch = self.batch
        inputs = prepare_inputs(batch, so, token_ids=False)  # at launch: _finish_prepare
        device = self.device
        buffers = self.buffers
        tables = batch.block_table.commit(batch.num_reqs)
        rows = buffers.block_table_rows.upload(inputs.block_table_rows)
        # Only the columns this step reaches: the CUDA planner sizes its key splits by the
        # table's width, and the gather copies less.
        widths = [-(-inputs.max_seq_len // t.block_size) for t in batch.block_table.tables]
        attn = AttentionMetadata(
            query_start_loc=buffers.query_start_loc.upload(inputs.query_start_loc),
            seq_lens=buffers.seq_lens.upload(inputs.seq_lens),
            block_tables=[t[:, :w].index_select(0, rows) for t, w in zip(tables, widths)],
            slot_mappings=[
                b.upload(s) for b, s in zip(buffers.slot_mappings, inputs.slot_mappings)
            ],
        )
        req_ids = inputs.sampling_req_ids
        sampling_rows = inputs.sampling_rows
        # Per-row arrays of the batch: one gather each, no walk over SamplingParams.
        sampling = SamplingTensors.from_arrays(
            batch.temperature[sampling_rows],
            batch.top_k[sampling_rows],
            batch.top_p[sampling_rows],
            device,
            buffers.sampling,
            batch.min_p[sampling_rows],
        )
        if batch.seeded[sampling_rows].any():
            generators = [self._generator(rid) for rid in req_ids]
        else:
            generators = [None] * len(req_ids)
        step = StepInputs(
            step_id=so.step_id,
            input_ids=None,
            positions=buffers.positions.upload(inputs.positions),
            attn=attn,
            logits_indices=buffers.logits_indices.upload(inputs.logits_indices),
            sampling_req_ids=req_ids,
            sampling_rows=sampling_rows,
            sampling=sampling,
            generators=generators,
            inputs=inputs,
        )
        if batch.num_extras:
            step.prompt_plan = self._prompt_plan(inputs)
        if batch.num_embeddings:
            want = np.flatnonzero(batch.wants_embedding[sampling_rows])
            if want.size:
                batch.embedded(sampling_rows[want])
                if self.config.rank == 0:  # only rank 0 answers the core
                    step.embed_rows = want
        if self._in_flight is None:
            self._finish_prepare(step)
        return step

    def _prompt_plan(self, inputs: ModelInputs) -> list[PromptPlan]:
        """The prompt tokens this step yields logprobs for, per asking request (prompt
        tokens are known at planning, whatever step is in flight)."""
        batch = self.batch
        rows = inputs.block_table_rows
        wanted = batch.num_prompt_logprobs[rows]
        plan: list[PromptPlan] = []
        for i in np.flatnonzero(wanted >= 0).tolist():
            row = int(rows[i])
            first = int(inputs.num_computed_tokens[i])
            flat_start = int(inputs.query_start_loc[i])
            scheduled = int(inputs.query_start_loc[i + 1]) - flat_start
            num_prompt = int(batch.num_prompt_tokens[row])
            if not scheduled or first >= num_prompt:
                continue  # decoding: its prompt was answered
            # The hidden state at position p predicts token p + 1, if that is a prompt token.
            count = max(min(first + scheduled, num_prompt - 1) - first, 0)
            targets = batch.token_ids[row, first + 1 : first + 1 + count].astype(np.int64)
            plan.append(
                PromptPlan(inputs.req_ids[i], first + 1, flat_start, targets, int(wanted[i]))
            )
        return plan

    def _prompt_logprobs(
        self, hidden: torch.Tensor, plan: list[PromptPlan]
    ) -> list[PromptLogprobs]:
        """Every rank takes the logits (the LM head gathers across TP ranks); rank 0
        turns them into logprobs."""
        answer = self.config.rank == 0
        out: list[PromptLogprobs] = []
        for p in plan:
            found: list[Logprobs] = []
            for a in range(0, len(p.targets), PROMPT_LOGPROBS_SLICE):
                b = min(a + PROMPT_LOGPROBS_SLICE, len(p.targets))
                at = torch.arange(p.flat_start + a, p.flat_start + b, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, at))
                if answer:
                    targets = torch.from_numpy(p.targets[a:b]).to(self.device)
                    every = torch.arange(b - a, device=self.device)
                    found += compute_logprobs(logits, every, targets, [p.num_top] * (b - a))
            out.append(PromptLogprobs(p.req_id, p.start, found))
        return out if answer else []

    def _finish_prepare(self, step: StepInputs) -> None:
        """What needs every token known: the token ids and the sampling extras."""
        inputs = step.inputs
        if self._in_flight is not None or inputs is None:
            raise RuntimeError("a step's token ids were asked for before they were known")
        batch = self.batch
        inputs.gather_token_ids(batch)
        step.input_ids = self.buffers.input_ids.upload(inputs.input_ids)
        if batch.num_extras and batch.extras[step.sampling_rows].any():
            step.logprob_rows, step.logprob_counts = self._sampling_extras(
                step.sampling, step.sampling_rows, step.sampling_req_ids
            )
        step.inputs = None

    @torch.inference_mode()
    def launch(self, step: StepInputs) -> InFlight:
        """Queue the step's forward and sampling (on a GPU nothing waits for them here) and
        reserve each sampling request's next token slot, filled by collect()."""
        if self._in_flight is not None:
            raise RuntimeError("launch: the previous step has not been collected")
        if step.input_ids is None:
            self._finish_prepare(step)
        clock = self.clock
        if clock is not None:
            clock.launch_begin()
        tuner = self.cpu_threads
        if tuner is not None:
            tuner.before_step(len(step.positions), len(step.attn.query_start_loc) - 1)
            start = time.perf_counter()
        hidden = self.model(step.input_ids, step.positions, step.attn, self.kv_caches)
        if step.prompt_plan:
            step.prompt_logprobs = self._prompt_logprobs(hidden, step.prompt_plan)
        tokens = logits = embed_hidden = None
        if step.sampling_req_ids:
            selected = hidden.index_select(0, step.logits_indices)
            logits = self.model.compute_logits(selected)
            tokens = sample(logits, step.sampling, step.generators, self.default_generator)
            if step.embed_rows is not None:
                rows = torch.from_numpy(step.embed_rows).to(self.device)
                embed_hidden = selected.index_select(0, rows).float()
        if tuner is not None:  # on the CPU the step has run by now
            tuner.after_step(time.perf_counter() - start)
        if step.sampling_req_ids:
            self.batch.reserve(step.sampling_rows)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if clock is not None:
            clock.launch_end()
        flight = InFlight(
            step,
            tokens,
            logits if step.logprob_rows is not None else None,
            done,
            self.batch.row_changes,
            embed_hidden,
        )
        self._in_flight = flight
        return flight

    def time_left(self, flight: InFlight) -> float:
        """Seconds until the launched step's tokens are ready: 0 when they are (on the
        CPU, as soon as launch returns); a short guess while a GPU still works."""
        if self.clock is not None and self.clock.delay_s:
            return self.clock.time_left()
        if flight.done is None or flight.done.query():
            return 0.0
        return 1e-4

    @torch.inference_mode()
    def collect(self, flight: InFlight) -> ModelRunnerOutput:
        """Wait for a launched step's tokens, record them in the batch, and answer."""
        if flight is not self._in_flight:
            raise RuntimeError("collect: not the step in flight")
        step = flight.step
        if self.clock is not None:
            self.clock.sync()
        tokens: list[int] = [] if flight.tokens is None else flight.tokens.tolist()
        if flight.logits is not None:
            assert step.logprob_rows is not None and flight.tokens is not None
            found = compute_logprobs(
                flight.logits, step.logprob_rows, flight.tokens, step.logprob_counts
            )
            logprobs: list[Logprobs | None] = [None] * len(step.sampling_req_ids)
            for i, lp in zip(step.logprob_rows.tolist(), found):
                logprobs[i] = lp
            step.logprobs = logprobs
        self._in_flight = None
        if self.grammars:
            self.grammars.consume(step.sampling_req_ids, tokens)
        self.batch.fill_reserved(
            step.sampling_req_ids,
            tokens,
            # A step planned meanwhile that finished, preempted or moved no request (a
            # steady decode) left the rows in place: one indexed write, no lookups.
            step.sampling_rows if self.batch.row_changes == flight.rows_at_launch else None,
        )
        if self.clock is not None:
            self.clock.collected()
        embeddings = []
        if flight.embed_hidden is not None:
            assert step.embed_rows is not None
            embeddings = self._embeddings(
                [step.sampling_req_ids[i] for i in step.embed_rows.tolist()], flight.embed_hidden
            )
        return ModelRunnerOutput(
            step.step_id,
            step.sampling_req_ids,
            tokens,
            step.logprobs,
            step.prompt_logprobs,
            embeddings,
        )

    def _embeddings(self, req_ids: list[str], hidden: torch.Tensor) -> list[PromptEmbedding]:
        """Each request's embedding from its last prompt token's final hidden state: the
        first `dimensions` values, L2-normalized unless it asked not to be."""
        out = []
        vectors = hidden.cpu()
        for req_id, vector in zip(req_ids, vectors):
            state = self.batch.requests.get(req_id)
            if state is None or state.sampling_params.embedding is None:
                continue
            spec = state.sampling_params.embedding
            if spec.dimensions is not None:
                vector = vector[: spec.dimensions]
            if spec.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            out.append(PromptEmbedding(req_id, vector.numpy().astype("<f4").tobytes()))
        return out

    def _sampling_extras(
        self, sampling: SamplingTensors, rows: np.ndarray, req_ids: list[str]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Logit biases, penalties, token masks (structured outputs, allowed_token_ids) and
        bans (bad words, min_tokens) into sampling; the logprob rows and counts. Only for
        a step in which some row uses one of them."""
        batch = self.batch
        device = self.device
        vocab = self.model_config.vocab_size
        presence = batch.presence_penalty[rows]
        frequency = batch.frequency_penalty[rows]
        repetition = batch.repetition_penalty[rows]
        num_tokens = batch.num_tokens[rows]
        num_prompt = batch.num_prompt_tokens[rows]
        if presence.any() or frequency.any() or (repetition != 1.0).any():
            sampling.penalties = PenaltyTensors.build(
                batch.token_ids[rows, : int(num_tokens.max())],
                num_prompt,
                num_tokens,
                presence,
                frequency,
                repetition,
                vocab,
                device,
            )
        biased = np.flatnonzero(batch.logit_biased[rows])
        if biased.size:
            sampling.bias = logit_bias_tensors(
                [
                    (i, batch.requests[req_ids[i]].sampling_params.logit_bias or {})
                    for i in biased.tolist()
                ],
                device,
            )
        limited = np.flatnonzero(batch.token_limited[rows]).tolist()
        sampling.token_masks = self._token_masks(req_ids, limited)
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for i in limited:
            # A bad word's last token, wherever the output ends with the rest of it.
            params = batch.requests[req_ids[i]].sampling_params
            row, end = int(rows[i]), int(num_tokens[i])
            output = batch.token_ids[row, int(num_prompt[i]) : end]
            for seq in params.bad_words_token_ids:
                k = len(seq) - 1
                if k <= len(output) and (k == 0 or output[len(output) - k :].tolist() == seq[:k]):
                    ban_rows.append(i)
                    ban_tokens.append(seq[-1])
        early = np.flatnonzero(batch.min_tokens[rows] > num_tokens - num_prompt)
        if early.size:
            # Below min_tokens nothing that would stop the request may be sampled.
            for i in early.tolist():
                params = batch.requests[req_ids[i]].sampling_params
                stops = list(params.stop_token_ids)
                if not params.ignore_eos:
                    stops += self.eos_token_ids
                stops = [t for t in stops if t < vocab]
                ban_rows += [i] * len(stops)
                ban_tokens += stops
        if ban_rows:
            sampling.banned = (
                torch.tensor(ban_rows, dtype=torch.int64, device=device),
                torch.tensor(ban_tokens, dtype=torch.int64, device=device),
            )
        if self.config.rank != 0:
            return None, []  # only rank 0 answers the core
        wanted = batch.num_logprobs[rows]
        asking = np.flatnonzero(wanted >= 0)
        if not asking.size:
            return None, []
        return torch.from_numpy(asking).to(device), wanted[asking].tolist()

    def _token_masks(
        self, req_ids: list[str], limited: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """SamplingTensors.token_masks: the tokens the step's constrained rows (structured
        outputs) and allowed_token_ids rows may not sample; a row with both, the union."""
        device, vocab = self.device, self.model_config.vocab_size
        parts: list[tuple[list[int], torch.Tensor]] = []
        if self.grammars:
            found = self.grammars.fill_bitmask(req_ids)
            if found is not None:
                parts.append((found[0], token_bans(found[1], vocab, device)))
        requests = self.batch.requests
        allowed = [
            (i, ids)
            for i in limited
            if (ids := requests[req_ids[i]].sampling_params.allowed_token_ids) is not None
        ]
        if allowed:
            bans = torch.ones((len(allowed), vocab), dtype=torch.bool, device=device)
            for k, (_, ids) in enumerate(allowed):
                bans[k, torch.tensor(ids, dtype=torch.int64, device=device)] = False
            parts.append(([i for i, _ in allowed], bans))
        if not parts:
            return None
        if len(parts) == 1:
            rows, bans = parts[0]
            return torch.tensor(rows, dtype=torch.int64, device=device), bans
        every = sorted({i for rows, _ in parts for i in rows})
        at = {i: k for k, i in enumerate(every)}
        union = torch.zeros((len(every), vocab), dtype=torch.bool, device=device)
        for rows, bans in parts:
            union[[at[i] for i in rows]] |= bans
        return torch.tensor(every, dtype=torch.int64, device=device), union

    def _generator(self, req_id: str) -> torch.Generator | None:
        """A seeded request draws from its own generator, so its tokens do not depend on
        its neighbours in the batch."""
        params = self.batch.requests[req_id].sampling_params
        if params.seed is None or params.temperature < GREEDY_TEMPERATURE:
            return None
        gen = self.generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[req_id] = gen
        return gen
