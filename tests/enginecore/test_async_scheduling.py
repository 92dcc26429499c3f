"""Async scheduling: the core sends step N+1 before step N's answer arrives.

Two levels. In one process, the real Scheduler and the real ModelRunner run the core's
overlapped loop step by step (the runner executes each step when it is sent, in order,
as a worker process does), so a test can place a stop, an abort or a preemption exactly
between scheduling N+1 and applying N. As users run it, `pagedserve generate` with and
without --no-async-scheduling gives the same outputs in every mode (and the core checks
every KV invariant after each step, and that no block is left held at idle).
"""

from __future__ import annotations

import json
import random
import re
from collections import deque
from pathlib import Path

import pytest

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.scheduler import Scheduler
from protocol.codec import Codec
from protocol.engine import RequestOutput, SamplingParams
from protocol.worker import (
    CoreToWorker,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerConfigure,
    WorkerToCore,
)
from tests.helpers.cli_helpers import generate_cli
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint
from tests.helpers.kv_helpers import sched_config
from tests.helpers.runner_driver import BLOCK_SIZE, make_runner
from worker.model_runner import ModelRunner

MAX_LEN = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("llama")
    return path, save_checkpoint("llama", path)


class Overlapped:
    """The core's async loop, in one process, one move at a time."""

    def __init__(self, runner: ModelRunner, num_blocks: int, eos: tuple[int, ...] = ()) -> None:
        groups = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30).kv_cache_groups
        kv_config = with_num_blocks(groups, num_blocks)
        config = sched_config(MAX_LEN, max_num_batched_tokens=64, max_num_seqs=8)
        self.scheduler = Scheduler(config, kv_config, VOCAB, eos)
        runner.initialize(WorkerConfigure(kv_config, 8, MAX_LEN, 64))
        self.runner = runner
        self.to_worker: Codec[CoreToWorker] = Codec(CoreToWorker, "core->worker")
        self.to_core: Codec[WorkerToCore] = Codec(WorkerToCore, "worker->core")
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        s = self.scheduler
        assert s.add_request(s.new_request(rid, prompt, params)) is None
        self.tokens[rid] = []

    def send(self) -> SchedulerOutput:
        """Schedule the next step and run it on the worker (answer kept for answer())."""
        so = self.scheduler.schedule()
        out = self.runner.execute(self.to_worker.decode(self.to_worker.encode(so)))
        if so.total_num_scheduled_tokens:
            assert out is not None
            self.in_flight.append((so, self.to_core.decode(self.to_core.encode(out))))
        return so

    def answer(self) -> list[RequestOutput]:
        """Apply the oldest step's answer, as the core does when it arrives."""
        so, out = self.in_flight.popleft()
        outputs = self.scheduler.update_from_output(so, out)
        for o in outputs:
            assert o.request_id not in self.finish, f"{o.request_id}: output after its end"
            self.tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
        self.scheduler.check_invariants()
        return outputs

    def run(self) -> None:
        """The core's loop to the end: two steps in flight whenever there is work."""
        while self.scheduler.has_unfinished_requests() or self.in_flight:
            sent = False
            if len(self.in_flight) < 2 and self.scheduler.has_unfinished_requests():
                sent = self.send().total_num_scheduled_tokens > 0
            if self.in_flight and (len(self.in_flight) == 2 or not sent):
                self.answer()
        self.close()

    def close(self) -> None:
        """Deliver the last finishes to the worker; nothing may stay held anywhere."""
        self.send()
        assert not self.in_flight
        self.scheduler.check_invariants()
        kv = self.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
        batch = self.runner.batch
        assert batch is not None and batch.num_reqs == 0 and not batch.requests


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 14))] for _ in range(n)]


def test_stops_at_step_n_emit_no_token_of_step_n_plus_1(llama) -> None:
    path, hf_model = llama
    a, b, c = prompts(3)
    want = {rid: hf_greedy(hf_model, p, 8) for rid, p in zip("abc", (a, b, c))}
    # a ends on a stop token (its 4th), b on EOS (its 3rd; c ignores EOS), c on
    # max_tokens (4). Neither token may come earlier where it would end a request.
    stop_a, eos_b = want["a"][3], want["b"][2]
    assert stop_a not in want["a"][:3]
    assert eos_b not in want["a"][:4] and eos_b not in want["b"][:2]
    loop = Overlapped(make_runner(str(path)), num_blocks=64, eos=(eos_b,))
    greedy = dict(temperature=0.0)
    loop.add("a", a, SamplingParams(max_tokens=8, stop_token_ids=[stop_a], **greedy))
    loop.add("b", b, SamplingParams(max_tokens=8, **greedy))
    loop.add("c", c, SamplingParams(max_tokens=4, ignore_eos=True, **greedy))

    # Step 1 prefills all three; step 2 (each request's placeholder token) is sent
    # before step 1's answer, and so on: two steps in flight from here on.
    loop.send()
    scheduled_after: dict[str, list[int]] = {rid: [] for rid in "abc"}
    while loop.scheduler.has_unfinished_requests():
        so = loop.send()
        for rid in so.cached_reqs.req_ids:
            scheduled_after[rid].append(so.step_id)
        before = dict(loop.finish)
        loop.answer()
        for rid in set(loop.finish) - set(before):
            # The request ended with a step that runs it already sent, except c, whose
            # end by length the core saw coming and did not schedule past.
            later = loop.in_flight[0][0].cached_reqs.req_ids if loop.in_flight else []
            assert (rid in later) == (rid != "c"), (rid, later)
    while loop.in_flight:
        loop.answer()
    loop.close()
    assert loop.tokens == {"a": want["a"][:4], "b": want["b"][:3], "c": want["c"][:4]}
    assert loop.finish == {"a": "stop", "b": "stop", "c": "length"}


def test_abort_with_two_steps_in_flight_frees_everything(llama) -> None:
    path, hf_model = llama
    ps = prompts(3, seed=2)
    loop = Overlapped(make_runner(str(path)), num_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, p in zip("xyz", ps):
        loop.add(rid, p, params)
    loop.send()
    loop.send()
    loop.answer()
    loop.send()  # two steps in flight, both running y
    assert len(loop.in_flight) == 2
    before = list(loop.tokens["y"])
    (aborted,) = loop.scheduler.abort_requests(["y"])
    assert aborted.finish_reason == "abort"
    loop.finish["y"] = "abort"
    loop.run()  # y's blocks were freed at once; its two answers in flight are dropped
    assert loop.tokens["y"] == before
    for rid, p in zip("xz", (ps[0], ps[2])):
        assert loop.tokens[rid] == hf_greedy(hf_model, p, 10), rid


def test_preempted_with_a_step_in_flight_keeps_its_token(llama) -> None:
    """A pool too small for both: scheduling N+1 preempts the latest request while step
    N, which samples its next token, is still in flight. The token is kept (the worker
    appended it too); the request resumes with it and ends equal to transformers."""
    path, hf_model = llama
    ps = prompts(2, seed=3)
    runner = make_runner(str(path))
    # Two requests of up to 14 + 24 tokens in blocks of 4: 10 blocks each at the end.
    loop = Overlapped(runner, num_blocks=1 + 14)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rid, p in zip("pq", ps):
        loop.add(rid, p, params)
    seen = 0
    while loop.scheduler.has_unfinished_requests() or loop.in_flight:
        sent = False
        if len(loop.in_flight) < 2 and loop.scheduler.has_unfinished_requests():
            so = loop.send()
            sent = so.total_num_scheduled_tokens > 0
            for rid in so.preempted_req_ids:
                seen += loop.scheduler.requests[rid].num_pending_tokens > 0
        if loop.in_flight and (len(loop.in_flight) == 2 or not sent):
            loop.answer()
    loop.close()
    assert seen, "no request was preempted with a step in flight"
    assert loop.scheduler.num_preemptions >= 1
    for rid, p in zip("pq", ps):
        assert loop.tokens[rid] == hf_greedy(hf_model, p, 24), rid
    assert BLOCK_SIZE == 4  # the pool above is sized for it


# -- as users run it ---------------------------------------------------------------------

MODES = {
    "prefix-caching": (),
    "no-prefix-caching": ("--no-prefix-caching",),
    "chunked-prefill": ("--max-num-batched-tokens", "7"),
    "preemption": (
        *("--num-gpu-blocks", "20", "--max-model-len", "48"),
        *("--max-num-seqs", "12", "--max-num-batched-tokens", "16"),
    ),
    "tp2": ("--tensor-parallel-size", "2"),
    # Each line a priority (-1, 0, 1): preemption takes the lowest, readmission by rank.
    "priority-preemption": (
        *("--num-gpu-blocks", "20", "--max-model-len", "48"),
        *("--max-num-seqs", "12", "--max-num-batched-tokens", "16"),
        *("--scheduling-policy", "priority"),
    ),
}


@pytest.fixture(scope="module")
def sliding(tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint with sliding-window and full layers, its prompts, and the lines to
    run: greedy and seeded requests, stop tokens placed mid-output, EOS not ignored."""
    path = tmp_path_factory.mktemp("qwen2_interleaved")
    hf_model = save_checkpoint("qwen2_interleaved", path)
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(11)]
    lines = []
    for i in range(12):
        prompt = [*shared[: 4 + i], *(rng.randrange(3, VOCAB) for _ in range(3 + i % 5))]
        line: dict = {"prompt_token_ids": prompt, "max_tokens": 6 + i % 7}
        if i % 3 == 2:
            line |= {"temperature": 1.0, "seed": 100 + i}
        else:
            line |= {"temperature": 0}
            greedy = hf_greedy(hf_model, prompt, 3)
            if i % 3 == 1 and greedy[2] not in greedy[:2]:  # stops on its third token
                line["stop_token_ids"] = [greedy[2]]
        lines.append(line)
    return path, lines, hf_model


@pytest.mark.parametrize("mode", list(MODES))
def test_async_outputs_equal_serial(sliding, mode: str, tmp_path: Path) -> None:
    path, lines, hf_model = sliding
    if "--scheduling-policy" in MODES[mode]:
        lines = [x | {"priority": i % 3 - 1} for i, x in enumerate(lines)]
    results, stderr = {}, ""
    for name, flags in (("serial", ("--no-async-scheduling",)), ("async", ())):
        out = tmp_path / name
        out.mkdir()
        proc, got = generate_cli(
            path, [json.dumps(x) for x in lines], out, "--block-size", "4", *MODES[mode], *flags
        )
        assert proc.returncode == 0, proc.stderr
        results[name], stderr = got, proc.stderr
    for s, a in zip(results["serial"], results["async"], strict=True):
        assert (a["token_ids"], a["finish_reason"]) == (s["token_ids"], s["finish_reason"]), s
        assert len(a["token_ids"]) <= lines[a["index"]]["max_tokens"]
    stopped = [r for r, x in zip(results["async"], lines) if "stop_token_ids" in x]
    assert stopped and all(r["finish_reason"] == "stop" for r in stopped)
    assert all(len(r["token_ids"]) == 3 for r in stopped)
    if mode == "priority-preemption":  # reordered and preempted, still transformers' tokens
        for r, x in zip(results["async"], lines):
            if x["temperature"] == 0 and "stop_token_ids" not in x:
                want = hf_greedy(hf_model, x["prompt_token_ids"], x["max_tokens"])
                # EOS is not ignored, and --max-model-len 48 may end it first.
                assert r["token_ids"] and r["token_ids"] == want[: len(r["token_ids"])]
    if "preemption" in mode:
        assert int(re.search(r"preemptions: (\d+)", stderr).group(1)) > 0, stderr
