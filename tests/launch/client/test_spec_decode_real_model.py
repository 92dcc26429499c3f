"""Speculative decoding on the real model (SmolLM2-135M-Instruct; the session fixture
real_model_dir): greedy answers with n-gram drafts equal the answers without (which
test_real_model.py holds against transformers), on copy-heavy chats where most drafts
are accepted, and a seeded sampled run repeats."""

from __future__ import annotations

from pathlib import Path

from launch import LLM, SamplingParams

PASSAGE = (
    "The river rises in the northern hills and runs south for two hundred miles. Along "
    "its banks the towns grew up one by one: first the mill town, then the market town, "
    "and last the port, where the river meets the sea."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item\n"
    "    return result\n"
)
CHATS = [
    [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Rewrite this code, renaming `items` to `goods`.\n\n{CODE}"}],
    [{"role": "user", "content": "Write two sentences about the sea."}],
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def test_greedy_answers_with_drafts_equal_answers_without(real_model_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=48, temperature=0)
    common = dict(device="cpu", max_model_len=512, log_level="warning")
    with LLM(str(real_model_dir), **common) as plain:
        want = [o.token_ids for o in plain.chat(CHATS, greedy, use_tqdm=False)]
    with LLM(str(real_model_dir), speculative_config=NGRAM, **common) as spec:
        got = [o.token_ids for o in spec.chat(CHATS, greedy, use_tqdm=False)]
        stats = spec.last_summary.stats
        sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=11)
        runs = [spec.chat(CHATS[:1], sampled, use_tqdm=False)[0].token_ids for _ in range(2)]
    assert got == want
    assert stats is not None and stats.spec_decode is not None
    assert stats.spec_decode.acceptance_rate > 0.5  # the copies are drafted right
    assert stats.spec_decode.mean_accepted_length > 2
    assert runs[0] == runs[1]
