"""/metrics with speculative decoding: vLLM's spec-decode counters (drafts, draft
tokens, accepted tokens, accepted by position) from a real server's engine; a server
without --speculative-config shows none of them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest
import torch

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
        streamed = _stream_with_logprobs(server.url, prompt)
    finally:
        server.stop()
    # Accepted drafts come with their logprobs: each the model's own, as transformers
    # computes it at that position.
    tokens, logprobs = streamed
    assert tokens == hf_greedy(hf_model, prompt, 24)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])
    assert logprobs == pytest.approx(want[:, 0].tolist(), abs=1e-3)
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


def _stream_with_logprobs(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A streamed greedy completion with logprobs through the official client: (token
    ids, their logprobs); every event's logprobs match its tokens."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens: list[int] = []
    logprobs: list[float] = []
    for chunk in stream:
        choice = chunk.choices[0]
        ids = choice.token_ids or []  # type: ignore[attr-defined]
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == len(ids)
        tokens += ids
        logprobs += choice.logprobs.token_logprobs or []
    return tokens, logprobs


def test_without_speculation_no_spec_decode_series_exist() -> None:
    server_metrics = ServerMetrics(MODEL_NAME, 64, lambda: 0)
    server_metrics.on_stats(SchedulerStats(1, 0, 0.1, 0, 0, 0, 1, num_sampled_tokens=1))
    assert b"spec_decode" not in server_metrics.exposition()
