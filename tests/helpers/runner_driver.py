"""The real worker path at logit level: the real Scheduler makes SchedulerOutputs, which
go through the wire codec into the real ModelRunner (batch.apply, prepare_inputs,
BlockTable, slot mapping, the model over the paged cache, the sampler).

A forward hook on the model (observing, not replacing) records the hidden state of every
scheduled token; the LM head turns it into logits, filed under (request, position) by
the SchedulerOutput's own accounting. A test then compares each with transformers'
logits over the request's final sequence. The workload makes every situation the
scheduler can put a request in happen: whole and chunked prefill, prefix hits, decode,
preemption and resumption, requests arriving while others decode.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.kv_cache_manager import KVCacheManager
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from launch.client.engine_args import EngineArgs, runner_config
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import CoreToWorker, SchedulerOutput, WorkerConfigure
from tests.helpers.kv_helpers import sched_config
from worker.model_runner import ModelRunner

BLOCK_SIZE = 4
GEN_TOKENS = 8
# The pool: what the longest request (26 tokens) can hold at once in all groups, and half
# as much again: it fits alone, but the workload cannot fit at once (preemption).
LONGEST_REQUEST = 26
MAX_NUM_BATCHED_TOKENS = 12
MAX_NUM_SEQS = 6
MAX_MODEL_LEN = 64


def workload(vocab: int, seed: int = 3) -> list[tuple[int, str, list[int]]]:
    """(arrival step, request id, prompt). b and e share prefixes with earlier requests
    (prefix hits once those are cached); c and d are longer than a step's token budget
    (chunked prefill); e arrives while the others decode."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    shared, long = tokens(9), tokens(18)
    return [
        (0, "a", [*shared, *tokens(2)]),
        (1, "b", [*shared, *tokens(5)]),
        (1, "c", long),
        (1, "d", tokens(15)),
        (6, "e", [*long[:13], *tokens(4)]),
    ]


@dataclass
class RunRecord:
    """What one run through the runner produced."""

    prompts: dict[str, list[int]]
    generated: dict[str, list[int]] = field(default_factory=dict)
    # request -> position -> logits [vocab] of every time that position was computed
    logits: dict[str, dict[int, list[torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    chunked: set[str] = field(default_factory=set)  # prompts computed over several steps
    prefix_hits: dict[str, int] = field(default_factory=dict)  # tokens found cached
    resumed: set[str] = field(default_factory=set)
    num_preemptions: int = 0
    # Preemptions of a request whose last scheduled step had not been answered yet.
    preempted_in_flight: int = 0
    max_in_flight: int = 1
    planned_ahead: int = 0  # steps planned while their predecessor was in flight
    decode_steps: int = 0  # steps in which some request computed exactly one new token

    def sequences(self) -> dict[str, list[int]]:
        return {k: self.prompts[k] + self.generated[k] for k in self.prompts}


def make_runner(model_dir: str, rank: int = 0, world_size: int = 1) -> ModelRunner:
    """A CPU float32 runner as a worker process builds it (TP joins from the environment)."""
    args = EngineArgs(model=model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, seed=7)
    return ModelRunner(runner_config(args, rank=rank, world_size=world_size))


def drive(
    runner: ModelRunner, params: SamplingParams | None = None, max_in_flight: int = 2
) -> RunRecord:
    """Run workload() to completion through a real Scheduler and this runner.

    max_in_flight 2 is async scheduling as the core does it: step N+1 is scheduled
    before step N's answer is applied, and the runner plans it before collecting step N
    (launched when it was sent), as a worker process does; 1 is the serial loop."""
    params = params or SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
    vocab = runner.model_config.vocab_size
    groups = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30).kv_cache_groups
    probe = KVCacheManager(with_num_blocks(groups, 2), max_model_len=MAX_MODEL_LEN)
    need = probe.max_blocks_held(LONGEST_REQUEST, MAX_NUM_BATCHED_TOKENS)
    kv_config = with_num_blocks(groups, 1 + need + need // 2)
    # Plain budget scheduling, for which workload()'s arrivals were written (chunked
    # prompts, prefix hits, preemptions, one of a request with a step in flight); the CPU's
    # prefill cap and its wave hold reorder steps (tests/enginecore/test_step_budget.py).
    config = sched_config(
        MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        prefill_tokens_per_request=0,
    )
    scheduler = Scheduler(config, kv_config, vocab)
    runner.initialize(
        WorkerConfigure(kv_config, MAX_NUM_SEQS, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS)
    )
    codec = Codec(CoreToWorker, "core->worker")
    arrivals = workload(vocab)
    record = RunRecord(
        prompts={rid: prompt for _, rid, prompt in arrivals}, max_in_flight=max_in_flight
    )
    # [SchedulerOutput, its answer (None until collected)], oldest first.
    in_flight: deque[list] = deque()
    launched: list = []  # [entry of in_flight, InFlight] launched, not collected

    def collect() -> None:
        entry, flight = launched.pop()
        entry[1] = runner.collect(flight)

    requests: dict[str, Request] = {}
    hidden: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda _m, _a, out: hidden.append(out))
    try:
        step = 0
        while arrivals or scheduler.has_unfinished_requests() or in_flight:
            while arrivals and arrivals[0][0] <= step:
                _, rid, prompt = arrivals.pop(0)
                hasher = scheduler.kv_cache_manager.block_hasher
                requests[rid] = Request(rid, prompt, hasher, sampling_params=params)
                assert scheduler.add_request(requests[rid]) is None
            step += 1
            sent = False
            if len(in_flight) < max_in_flight and scheduler.has_unfinished_requests():
                so = scheduler.schedule()
                record.preempted_in_flight += sum(
                    requests[rid].num_pending_tokens > 0 for rid in so.preempted_req_ids
                )
                wire = codec.decode(codec.encode(so))
                # As the worker does: plan this step before collecting the one in flight
                # when it can (its token ids are gathered at launch, after the collect).
                if launched and not runner.can_plan_ahead(wire):
                    collect()
                planned = runner.plan(wire)
                record.planned_ahead += bool(launched) and planned is not None
                if launched:
                    collect()
                entry = [so, None]
                if planned is not None:
                    hidden.clear()
                    launched.append((entry, runner.launch(planned)))
                    _record_logits(runner, so, hidden[0], requests, record)
                    in_flight.append(entry)
                    sent = True
            if in_flight and (len(in_flight) == max_in_flight or not sent):
                if launched and launched[0][0] is in_flight[0]:
                    collect()
                so, out = in_flight.popleft()
                assert out is not None
                scheduler.update_from_output(so, out)
            scheduler.check_invariants()
    finally:
        hook.remove()
    record.generated = {rid: r.all_token_ids[r.num_prompt_tokens :] for rid, r in requests.items()}
    record.logits = {rid: dict(p) for rid, p in record.logits.items()}
    record.num_preemptions = scheduler.num_preemptions
    return record


def _record_logits(
    runner: ModelRunner,
    so: SchedulerOutput,
    hidden: torch.Tensor,
    requests: dict[str, Request],
    record: RunRecord,
) -> None:
    cached = so.cached_reqs
    starts = [(r.req_id, r.num_computed_tokens) for r in so.new_reqs]
    starts += list(zip(cached.req_ids, cached.num_computed_tokens))
    record.resumed.update(rid for rid, r in zip(cached.req_ids, cached.resumed) if r)
    for r in so.new_reqs:
        if r.num_computed_tokens:
            record.prefix_hits[r.req_id] = r.num_computed_tokens
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden[: so.total_num_scheduled_tokens])
    offset = 0
    for (rid, start), n in zip(starts, so.num_scheduled_tokens):
        if n == 1:
            record.decode_steps += 1
        if start + n < requests[rid].num_prompt_tokens:
            record.chunked.add(rid)
        for i in range(n):
            record.logits[rid][start + i].append(logits[offset + i].clone())
        offset += n


def check_coverage(record: RunRecord) -> None:
    """The workload reached every situation it exists for."""
    assert record.chunked, "no chunked prefill"
    assert record.prefix_hits, "no prefix hit"
    assert record.decode_steps, "no decode"
    assert record.num_preemptions and record.resumed, "no preemption and resumption"


def check_against_hf(
    record: RunRecord, hf_model: torch.nn.Module, atol: float = 1e-4, rtol: float = 1e-4
) -> None:
    """Every logit the runner computed equals transformers' over the final sequence."""
    for rid, seq in record.sequences().items():
        assert len(record.generated[rid]) == GEN_TOKENS, rid
        with torch.no_grad():
            want = hf_model(torch.tensor([seq[:-1]])).logits[0].float()
        positions = sorted(record.logits[rid])
        # Every position up to the last sampled token's input was computed at least once
        # (a prefix hit skips the cached ones).
        first = record.prefix_hits.get(rid, 0)
        assert positions[-1] == len(seq) - 2, rid
        assert set(range(first, len(seq) - 1)) <= set(positions), rid
        for pos in positions:
            for got in record.logits[rid][pos]:
                torch.testing.assert_close(
                    got,
                    want[pos],
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, r=rid, p=pos: f"request {r} position {p}: {m}",
                )
