"""The start-up log says when max_num_seqs requests of max_model_len tokens cannot hold
their KV cache at once (then some of them are preempted and recomputed), and stays quiet
when they can; a real `pagedserve generate` on the built-in model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import generate_cli

# 33 blocks of 4 tokens, 32 usable; a request of max_model_len 32 holds 8: four fit.
POOL = ("--num-gpu-blocks", "33", "--block-size", "4", "--max-model-len", "32")


@pytest.mark.parametrize(("max_num_seqs", "warned"), [(4, False), (5, True)])
def test_start_up_warns_when_max_num_seqs_long_requests_cannot_fit(
    tmp_path: Path, max_num_seqs: int, warned: bool
) -> None:
    line = json.dumps({"prompt": "abc", "max_tokens": 2})
    proc, results = generate_cli(None, [line], tmp_path, *POOL, "--max-num-seqs", str(max_num_seqs))
    assert proc.returncode == 0, proc.stderr
    assert len(results) == 1 and len(results[0]["token_ids"]) == 2
    warning = (
        f"the KV cache holds 4 request(s) of max_model_len 32 at once, fewer than "
        f"max_num_seqs {max_num_seqs}"
    )
    assert (warning in proc.stderr) is warned, proc.stderr
