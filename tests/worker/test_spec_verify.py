"""Drafts through the real Scheduler and the real ModelRunner in one process (frames
through the wire codec): greedy tokens equal a run without drafts, seeded sampled runs
repeat, and after every step each running request's block tables in the worker equal
the core's, including after the core freed the blocks of rejected drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from enginecore.kv_cache_config import make_kv_cache_config, with_num_blocks
from enginecore.scheduler import Scheduler
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.worker import CoreToWorker, ModelRunnerOutput, WorkerConfigure, WorkerToCore
from tests.helpers.hf_checkpoints import VOCAB, save_checkpoint
from tests.helpers.kv_helpers import sched_config
from tests.helpers.runner_driver import make_runner

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
MAX_LEN, CHUNK, SEQS = 64, 32, 8


def prompts() -> dict[str, list[int]]:
    """Prompts repeating short motifs, so the drafter finds matches."""
    rng = random.Random(5)
    out = {}
    for i in range(6):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 5))]
        out[f"r{i}"] = (motif * 6)[: rng.randrange(9, 20)]
    return out


def drive(
    path: Path,
    spec: dict | None,
    params: SamplingParams | dict[str, SamplingParams],
    logprobs: dict[str, list] | None = None,
    accepted: dict[str, int] | None = None,
) -> tuple[dict, int]:
    """Run prompts() to the end (params: one for all, or by request id); (each request's
    tokens, blocks the core freed after a verification), checking the worker's tables
    against the core's after each step. logprobs, accepted: filled with each request's
    logprobs and its number of accepted drafts."""
    runner = make_runner(str(path))
    groups = make_kv_cache_config(runner.kv_cache_specs(), 1 << 30).kv_cache_groups
    kv_config = with_num_blocks(groups, 200)
    config = sched_config(
        MAX_LEN, max_num_batched_tokens=CHUNK, max_num_seqs=SEQS, speculative_config=spec
    )
    sched = Scheduler(config, kv_config, runner.model_config.vocab_size)
    runner.initialize(WorkerConfigure(kv_config, SEQS, MAX_LEN, CHUNK))
    to_worker, to_core = Codec(CoreToWorker, "c->w"), Codec(WorkerToCore, "w->c")
    requests = {}
    for rid, prompt in prompts().items():
        own = params if isinstance(params, SamplingParams) else params[rid]
        requests[rid] = sched.new_request(rid, prompt, own)
        assert sched.add_request(requests[rid]) is None
    freed = 0
    kv = sched.kv_cache_manager
    while sched.has_unfinished_requests():
        so = sched.schedule()
        before = {
            r.request_id: sum(map(len, kv.get_block_ids(r.request_id))) for r in sched.running
        }
        out = runner.execute(to_worker.decode(to_worker.encode(so)))
        assert isinstance(out, ModelRunnerOutput)
        if accepted is not None and out.spec_token_ids:
            for rid, extra in zip(out.req_ids, out.spec_token_ids):
                accepted[rid] = accepted.get(rid, 0) + len(extra)
        for o in sched.update_from_output(so, to_core.decode(to_core.encode(out))):
            if logprobs is not None and o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_token_ids)
                logprobs.setdefault(o.request_id, []).extend(o.logprobs)
        sched.check_invariants()
        tables = runner.block_tables()
        for request in sched.running:
            rid = request.request_id
            assert tables[rid] == [list(ids) for ids in kv.get_block_ids(rid)], rid
            if rid in so.spec_token_ids:
                freed += before[rid] - sum(map(len, kv.get_block_ids(rid)))
    tokens = {rid: r.all_token_ids[r.num_prompt_tokens :] for rid, r in requests.items()}
    return tokens, freed


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_with_drafts_equal_tokens_without(arch: str, tmp_path: Path) -> None:
    save_checkpoint(arch, tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = drive(tmp_path, None, params)
    drafted, freed = drive(tmp_path, NGRAM, params)
    assert drafted == plain
    if arch == "llama":  # rejections that emptied a lookahead block happened
        assert freed > 0


def test_seeded_sampled_runs_with_drafts_repeat(tmp_path: Path) -> None:
    save_checkpoint("gemma3", tmp_path)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    first, _ = drive(tmp_path, NGRAM, params)
    again, _ = drive(tmp_path, NGRAM, params)
    assert first == again


def test_penalties_biases_bans_and_logprobs_verify_per_position(tmp_path: Path) -> None:
    # Each verified position must see the drafts before it as generated tokens: the
    # penalties count them, min_tokens and bad words look at them; logprobs come with
    # every accepted token. A large logit bias makes each output repeat (drafts are then
    # accepted) until its penalty or ban says otherwise, at a position inside a draft.
    # Greedy tokens and logprobs equal a run without drafts.
    save_checkpoint("llama", tmp_path)
    base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = list(prompts())
    forced = {7: 50.0}
    params = {
        ids[0]: SamplingParams(
            **base, logit_bias={7: 50.0, 9: 45.0}, frequency_penalty=2.0, logprobs=2
        ),
        ids[1]: SamplingParams(**base, logit_bias=forced, repetition_penalty=1.3),
        ids[2]: SamplingParams(**base, logit_bias={7: 50.0, 9: 49.0}, presence_penalty=2.0),
        ids[3]: SamplingParams(
            **base, logit_bias={8: 60.0, 9: 50.0}, allowed_token_ids=list(range(3, VOCAB, 2))
        ),
        ids[4]: SamplingParams(**base, logit_bias=forced, bad_words_token_ids=[[7, 7, 7]]),
        ids[5]: SamplingParams(
            max_tokens=24,
            temperature=0.0,
            min_tokens=9,
            logit_bias=forced,
            stop_token_ids=[7],
            logprobs=0,
        ),
    }
    plain_lp: dict[str, list] = {}
    drafted_lp: dict[str, list] = {}
    plain, _ = drive(tmp_path, None, params, plain_lp)
    accepted: dict[str, int] = {}
    drafted, _ = drive(tmp_path, NGRAM, params, drafted_lp, accepted)
    assert drafted == plain
    assert all(accepted.get(rid, 0) >= 2 for rid in ids[:5]), accepted
    assert len(plain[ids[5]]) == 10  # min_tokens held the stop token back to its 10th
    assert drafted_lp.keys() == {ids[0], ids[5]}
    for rid, lps in plain_lp.items():
        assert [lp.logprob for lp in drafted_lp[rid]] == pytest.approx(
            [lp.logprob for lp in lps], abs=1e-4
        )
        assert [lp.top_token_ids for lp in drafted_lp[rid]] == [lp.top_token_ids for lp in lps]
