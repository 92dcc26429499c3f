"""Serving prompts through a real engine for the KV tier tests: in batches whose order
fixes what the pool evicts and so what the tier stores and loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launch import LLM, SamplingParams
from protocol.engine import SchedulerStats


def serve_in_batches(
    model: Path,
    prompts: list[list[int]],
    params: SamplingParams,
    batch: int = 1,
    **settings: Any,
) -> tuple[list[tuple[list[int], int]], SchedulerStats | None]:
    """(tokens, cached prompt tokens) per prompt, `batch` prompts at a time (1: eviction
    order, and the tier's traffic, are fixed); the engine's last SchedulerStats."""
    with LLM(str(model), **settings) as llm:
        out = []
        for i in range(0, len(prompts), batch):
            for res in llm.generate(prompts[i : i + batch], params, use_tqdm=False):
                out.append((res.token_ids, res.num_cached_tokens))
        return out, llm.last_summary.stats
