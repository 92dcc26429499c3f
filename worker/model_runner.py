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

import numpy as np
import torch

from pagedkernels import cpu_elementwise
from pagedkernels.selection import select_kernels
from protocol.config import WorkerConfig, available_host_memory
from protocol.cpu_placement import pin_process
from protocol.engine import GREEDY_TEMPERATURE, Logprobs
from protocol.kv_cache import KVCacheSpec
from protocol.worker import (
    ModelRunnerOutput,
    PromptEmbedding,
    PromptLogprobs,
    RestoredBlock,
    SchedulerOutput,
    TierStep,
    WorkerConfigure,
)
from worker.attention import AttentionMetadata
from worker.cpu_threads import CpuThreadTuner, pick_cpu_threads
from worker.gemm import describe_products, small_batch_kernel, use_onednn
from worker.generation_config import load_generation_config
from worker.input_batch import InputBatch
from worker.kv_budget import available_kv_memory
from worker.kv_cache_memory import (
    allocate_kv_caches,
    kv_cache_storage_bytes,
    profile_step,
)
from worker.kv_host_tier import HostKVTier, make_kv_tier
from worker.layers import GatedMLP, Linear, ParallelLMHead, RMSNorm
from worker.model_config import load_model_config
from worker.model_inputs import ModelInputs, prepare_inputs
from worker.models import get_model_class
from worker.models.llama import LlamaAttention
from worker.parallel import TPContext, dist_init_method_from_env, init_distributed
from worker.sampler import SamplingTensors, compute_logprobs, sample
from worker.sampling_extras import SamplingExtras
from worker.spec_verify import end_drafts, record_accepted, run_verification, write_drafts
from worker.staging import StepBuffers
from worker.step_hooks import StepHooks
from worker.step_state import InFlight, PromptPlan, StepInputs
from worker.structured_output import GrammarMatchers
from worker.weights import iterate_weights

log = logging.getLogger("pagedserve.worker")

# Prompt positions whose logits are taken at once for prompt_logprobs: a chunk of a long
# prompt would otherwise hold [chunk, vocab] float32 logits (8192 x 150k: 4.9 GB).
PROMPT_LOGPROBS_SLICE = 512
NO_SPEC_TOKENS: list[list[int]] = []  # shared by every answer without drafts; never mutated
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


class ModelRunner:
    # Built by initialize() (WorkerConfigure): the persistent batch and step buffers.
    batch: InputBatch
    buffers: StepBuffers
    extras: SamplingExtras

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
        if self.device.type == "cpu":
            if config.cpus:
                pin_process(os.getpid(), config.cpus)
            if "OMP_NUM_THREADS" not in os.environ:
                # Pinned: a thread per core of its own; else a share of every core.
                threads = len(config.cpus) if config.cpus else pick_cpu_threads(config.world_size)
                torch.set_num_threads(threads)
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
        head_dim = self.model_config.head_dim
        kernels = select_kernels(
            self.device, self.dtype, head_dim, config.attention, config.native_kernels
        )
        self.model = cls(self.model_config, self.dtype, self.device, self.tp, kernels)
        self.model.load_weights(iterate_weights(config.model))
        self.model.eval()
        self.elementwise = "torch"
        if self.device.type == "cpu" and self.dtype == torch.float32 and config.native_kernels:
            self.elementwise = use_native_elementwise(self.model)
        self.cpu_gemm = (
            "onednn" if use_onednn(self.device, self.dtype, config.cpu_gemm) else "torch"
        )
        small_batch = self.cpu_gemm == "onednn" and self._pack_products(config)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_tier: HostKVTier | None = None  # WorkerConfigure's kv_tier_slots
        self.kv_tier_restored: list[RestoredBlock] = []  # read back from its disk tier
        self.generators: dict[str, torch.Generator] = {}
        # Requests whose output must stay inside a language (structured outputs).
        self.grammars = GrammarMatchers(config.model, self.eos_token_ids)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._in_flight: InFlight | None = None  # launched, not yet collected
        # Installed by the worker process when its config names some (benchmarks).
        self.hooks: StepHooks | None = None
        kernels = {layer.kernels.name for layer in self.model.attention_layers().values()}
        # Logged at warning level so it shows at the default level: which kernels run
        # decides both speed and numerics.
        log.warning(
            "rank %d: %s on %s in %s; attention kernels: %s%s%s",
            config.rank,
            self.model_config.architecture,
            self.device,
            self.dtype,
            ", ".join(sorted(kernels)),
            describe_products(self.cpu_gemm, small_batch),
            "; norms, rotary, activation: C kernels" if self.elementwise != "torch" else "",
        )

    def _pack_products(self, config: WorkerConfig) -> bool:
        """Packs every dense weight for oneDNN, and for the small-batch kernel where it runs
        (worker.gemm); whether it does."""
        dense = [m for m in self.model.modules() if isinstance(m, (Linear, ParallelLMHead))]
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in dense)
        small = small_batch_kernel(
            self.dtype, config.cpu_gemm, config.native_kernels, nbytes, available_host_memory()
        )
        for module in dense:
            module.pack_weight(small)
        return small is not None

    # -- start-up ---------------------------------------------------------------------
    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        kv_dtype = str(self.dtype).removeprefix("torch.")
        return self.model.kv_cache_specs(self.config.block_size, kv_dtype)

    def available_kv_memory(self) -> int:
        """Bytes this worker can give its KV cache (worker/kv_budget.py)."""
        return available_kv_memory(self)

    def profile_step(self, num_tokens: int, num_seqs: int) -> int:
        """The peak allocation of the largest step (kv_cache_memory.profile_step)."""
        max_len = self.model_config.max_position_embeddings
        return profile_step(
            self.model,
            max_len,
            self.config.block_size,
            self.dtype,
            self.device,
            num_tokens,
            num_seqs,
        )

    def kv_cache_storage_bytes(self) -> tuple[int, int]:
        """(bytes, buffers) of KV storage really allocated."""
        return kv_cache_storage_bytes(self.kv_caches)

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
        caches = allocate_kv_caches(config, specs, self.dtype, self.device, self.config.rank)
        missing = sorted(set(layers) - set(caches))
        if missing:
            raise ValueError(f"KV cache config leaves layers without a cache: {missing}")
        self.kv_caches = [caches[name] for name in layers]
        self.kv_tier, self.kv_tier_restored = make_kv_tier(
            msg, self.kv_caches, self.config, self.tp
        )
        # One extra column: a request's last sampled token lands at position max_model_len.
        self.batch = InputBatch(msg.max_num_reqs, msg.max_model_len + 1, block_sizes, self.device)
        self.buffers = StepBuffers(
            msg.max_num_batched_tokens, msg.max_num_reqs, len(block_sizes), self.device
        )
        self.extras = SamplingExtras(
            self.batch,
            self.grammars,
            self.eos_token_ids,
            self.model_config.vocab_size,
            self.device,
            answers=self.config.rank == 0,
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
        if so.__class__ is TierStep:
            so = self._kv_tier_transfers(so)  # type: ignore[arg-type]
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
        if self.hooks is not None:
            self.hooks.planning()
        return self.prepare_step(so)

    def _kv_tier_transfers(self, so: TierStep) -> SchedulerOutput:
        # Before the step's forward; a step in flight before it ran first (on the CPU it
        # is done, on a GPU the copies queue behind it), so stores read its writes.
        if self.kv_tier is None:
            raise ValueError(f"step {so.step_id} moves KV tier blocks, but no tier is configured")
        return self.kv_tier.run_step(so)  # rewritten when a disk load failed

    def can_plan_ahead(self, so: SchedulerOutput) -> bool:
        """Whether `so` can be planned while the previous step's tokens are unknown: not
        when it preempts or resumes a request (its last token may be on its way), nor
        when it reuses the id of a request it finishes (that token would go to the new
        one), nor after a step with drafts (how many it accepts moves the positions).
        Rare; such a step waits for them."""
        flight = self._in_flight
        if so.preempted_req_ids or any(so.cached_reqs.resumed):
            return False
        if flight is not None and flight.step.drafts is not None:
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
        drafts = (
            write_drafts(batch, so, self.model_config.vocab_size) if so.spec_token_ids else None
        )
        inputs = prepare_inputs(batch, so, token_ids=False)  # at launch: _finish_prepare
        if drafts is not None:
            end_drafts(batch, so, drafts, inputs)
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
            drafts=drafts,
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
            step.logprob_rows, step.logprob_counts = self.extras.fill(
                step.sampling, step.sampling_rows, step.sampling_req_ids, step.drafts
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
        hooks = self.hooks
        if hooks is not None:
            hooks.launch_begin()
        tuner = self.cpu_threads
        if tuner is not None:
            tuner.before_step(len(step.positions), len(step.attn.query_start_loc) - 1)
            start = time.perf_counter()
        hidden = self.model(step.input_ids, step.positions, step.attn, self.kv_caches)
        if step.prompt_plan:
            step.prompt_logprobs = self._prompt_logprobs(hidden, step.prompt_plan)
        tokens = logits = embed_hidden = spec_tokens = None
        if step.drafts is not None:
            verified = run_verification(self.model, hidden, step, self.default_generator)
            selected, logits, tokens, spec_tokens = verified
        elif step.sampling_req_ids:
            selected = hidden.index_select(0, step.logits_indices)
            logits = self.model.compute_logits(selected)
            tokens = sample(logits, step.sampling, step.generators, self.default_generator)
        if step.sampling_req_ids and step.embed_rows is not None:
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
        if hooks is not None:
            hooks.launch_end()
        flight = InFlight(
            step,
            tokens,
            logits if step.logprob_rows is not None else None,
            done,
            self.batch.row_changes,
            embed_hidden,
            spec_tokens,
        )
        self._in_flight = flight
        return flight

    def time_left(self, flight: InFlight) -> float:
        """Seconds until the launched step's tokens are ready: 0 when they are (on the
        CPU, as soon as launch returns); a short guess while a GPU still works."""
        if self.hooks is not None:
            left = self.hooks.time_left()
            if left is not None:
                return left
        if flight.done is None or flight.done.query():
            return 0.0
        return 1e-4

    @torch.inference_mode()
    def collect(self, flight: InFlight) -> ModelRunnerOutput:
        """Wait for a launched step's tokens, record them in the batch, and answer."""
        if flight is not self._in_flight:
            raise RuntimeError("collect: not the step in flight")
        step = flight.step
        if self.hooks is not None:
            self.hooks.sync()
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
        if flight.spec_tokens is not None:
            assert step.drafts is not None
            record_accepted(self.batch, step.sampling_req_ids, flight.spec_tokens, step.drafts)
        if self.hooks is not None:
            self.hooks.collected()
        embeddings = []
        if flight.embed_hidden is not None:
            assert step.embed_rows is not None
            embeddings = self._embeddings(
                [step.sampling_req_ids[i] for i in step.embed_rows.tolist()], flight.embed_hidden
            )
        out = ModelRunnerOutput(
            step.step_id,
            step.sampling_req_ids,
            tokens,
            step.logprobs,
            step.prompt_logprobs,
            embeddings,
            flight.spec_tokens or NO_SPEC_TOKENS,
            step.drafts.extra_logprobs if step.drafts is not None else [],
        )
        return out if self.kv_tier is None else self.kv_tier.answer(out)

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


def use_native_elementwise(model: torch.nn.Module) -> str:
    """Give a float32 CPU model the C element-wise kernels (pagedkernels.cpu_elementwise)
    and, with them, stacked q/k/v and gate/up products, before its weights are packed;
    which element-wise path runs."""
    native = cpu_elementwise.load()
    if native is None:
        return "torch"
    for module in list(model.modules()):
        if isinstance(module, (RMSNorm, GatedMLP, LlamaAttention)):
            module.native = native
        if isinstance(module, (GatedMLP, LlamaAttention)):
            module.fuse_projections()
    return "C kernels"
