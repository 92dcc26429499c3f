"""Speculative decoding through the whole engine (`pagedserve generate`, core and worker
processes): greedy tokens with drafts verified must equal transformers' own generate(),
for every KV layout (full attention, sliding windows, hybrid groups), with prefix
caching on and off, chunked prefill, preemption, tensor parallel 2, both methods.

The prompts repeat their start after the model's own continuation of it, so the n-gram
drafter finds matches; the Gemma 3 checkpoint falls into cycles it accepts in full,
which exercises multi-token acceptance, lookahead blocks and the tables' cut."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import generate_cli
from tests.helpers.hf_checkpoints import VOCAB, hf_greedy, save_checkpoint

MAX_TOKENS = 16
NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
)
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'

MODES = {
    "prefix-caching": (),
    "no-prefix-caching": ("--no-prefix-caching",),
    "chunked-prefill": ("--max-num-batched-tokens", "7"),
    # Too few blocks for the eight requests at once (see test_engine_e2e).
    "preemption": (
        "--num-gpu-blocks",
        "{blocks}",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "48",
        "--max-num-batched-tokens",
        "16",
    ),
}
PREEMPTION_BLOCKS = {"gemma3": 50}


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model dir, prompts, transformers' greedy continuations)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(request.param, path)
    rng = random.Random(11)
    prompts, expected = [], []
    for n in (4, 5, 6, 8, 4, 7, 5, 6):
        while True:
            start = [rng.randrange(3, VOCAB) for _ in range(n)]
            try:  # hf_greedy refuses a path with a near-tie: draw another start
                prompt = start + hf_greedy(hf_model, start, 10) + start
                expected.append(hf_greedy(hf_model, prompt, MAX_TOKENS))
            except AssertionError:
                continue
            prompts.append(prompt)
            break
    return path, prompts, expected


def run(checkpoint, tmp_path: Path, *flags: str) -> str:
    """Generate with the flags; check every token against transformers; the stderr."""
    path, prompts, expected = checkpoint
    lines = [
        json.dumps(
            {"prompt_token_ids": p, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        )
        for p in prompts
    ]
    proc, results = generate_cli(path, lines, tmp_path, "--block-size", "4", *flags)
    assert proc.returncode == 0, proc.stderr
    assert len(results) == len(prompts)
    for r, want in zip(results, expected):
        assert r["token_ids"] == want, f"prompt {r['index']} {flags}"
        assert r["finish_reason"] == "length"
    return proc.stderr


def spec_figures(stderr: str) -> tuple[int, float]:
    """(verifications, mean accepted length) from the run summary."""
    m = re.search(r"spec decode: (\d+) verifications.*mean accepted length ([\d.]+)", stderr)
    assert m, stderr
    return int(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "checkpoint", ["llama", "mistral", "qwen2_interleaved", "gemma3"], indirect=True
)
def test_greedy_tokens_with_ngram_drafts_equal_transformers(
    checkpoint, mode: str, tmp_path: Path
) -> None:
    name = checkpoint[0].name
    blocks = str(next((b for f, b in PREEMPTION_BLOCKS.items() if name.startswith(f)), 20))
    flags = [f.replace("{blocks}", blocks) for f in MODES[mode]]
    # Asked for explicitly: speculation runs one step at a time all the same.
    stderr = run(checkpoint, tmp_path, "--speculative-config", NGRAM, "--async-scheduling", *flags)
    verifications, mean_length = spec_figures(stderr)
    assert verifications > 0
    if checkpoint[0].name.startswith("gemma3"):
        assert mean_length > 1.5, stderr  # several drafts accepted per verification
    if mode == "preemption":
        assert int(re.search(r"preemptions: (\d+)", stderr).group(1)) > 0, stderr


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_tensor_parallel_2_with_drafts_equals_transformers(checkpoint, tmp_path: Path) -> None:
    stderr = run(checkpoint, tmp_path, "--speculative-config", NGRAM, "--tensor-parallel-size", "2")
    assert spec_figures(stderr)[1] > 1.5


@pytest.mark.parametrize("checkpoint", ["gemma3", "llama"], indirect=True)
def test_suffix_drafts_equal_transformers(checkpoint, tmp_path: Path) -> None:
    verifications, _ = spec_figures(run(checkpoint, tmp_path, "--speculative-config", SUFFIX))
    assert verifications > 0
