"""/metrics with speculative decoding: vLLM's spec-decode counters (drafts, draft
tokens, accepted tokens, accepted by position) from a real server's engine; a server
without --speculative-config shows none of them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from launch.openai.metrics import ServerMetrics
from protocol.engine import SchedulerStats
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint
from tests.helpers.server import MODEL_NAME, metrics, post, start_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def test_spec_decode_counters_count_the_engines_verifications(tmp_path: Path) -> None:
    hf_model = save_checkpoint("gemma3", tmp_path / "model")  # falls into cycles: accepts
    start = [random.Random(2).randrange(3, VOCAB) for _ in range(5)]
    prompt = start + hf_greedy(hf_model, start, 10) + start
    server = start_server(
        tmp_path / "model",
        tmp_path / "run",
        *("--block-size", "4", "--speculative-config", json.dumps(NGRAM)),
    )
    try:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        status, answer = post(f"{server.url}/v1/completions", {**body, "ignore_eos": True})
        assert status == 200, answer
        m = metrics(server.url)
    finally:
        server.stop()
    drafts = m["vllm:spec_decode_num_drafts_total"]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [
        m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(3)
    ]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    assert 0 < accepted <= draft_tokens
    assert sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # a draft is accepted only after the one before
    assert m["vllm:generation_tokens_total"] == 24  # several tokens per output counted


def test_without_speculation_no_spec_decode_series_exist() -> None:
    server_metrics = ServerMetrics(MODEL_NAME, 64, lambda: 0)
    server_metrics.on_stats(SchedulerStats(1, 0, 0.1, 0, 0, 0, 1, num_sampled_tokens=1))
    assert b"spec_decode" not in server_metrics.exposition()
