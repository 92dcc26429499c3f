"""Speculative decoding's Prometheus series, under vLLM's names: verifications that had
drafts, drafted tokens, accepted drafts, and accepted drafts by position (label
"position", 0 for the first draft). Fed by the cumulative SpecDecodeStats in each
step's SchedulerStats; defined at the first such stats, so a server without
--speculative-config shows none of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import prometheus_client as prom

from protocol.speculative import SpecDecodeStats


class SpecDecodeMetrics:
    def __init__(self, metric: Callable[..., Any], model: str, engines: int) -> None:
        self._metric = metric  # ServerMetrics._metric: a family labelled model and engine
        self._model = model
        self._engines = engines
        self._families: tuple[Any, Any, Any, Any] | None = None
        self._last: list[SpecDecodeStats | None] = [None] * engines

    def _define(self) -> tuple[Any, Any, Any, Any]:
        if self._families is None:
            counter = prom.Counter
            self._families = (
                self._metric(counter, "vllm:spec_decode_num_drafts", "Verifications with drafts."),
                self._metric(counter, "vllm:spec_decode_num_draft_tokens", "Drafted tokens."),
                self._metric(counter, "vllm:spec_decode_num_accepted_tokens", "Accepted drafts."),
                self._metric(
                    counter,
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted drafts by position in their draft (0: the first).",
                    ["position"],
                ),
            )
        return self._families

    def update(self, engine: int, stats: SpecDecodeStats) -> None:
        """Add what is new since the engine's last stats (a restarted engine's counts
        start again from zero)."""
        drafts, tokens, accepted, per_pos = self._define()
        last = self._last[engine]
        if last is None or stats.num_drafts < last.num_drafts:
            last = SpecDecodeStats(0, 0, 0, [0] * len(stats.accepted_per_pos))
        labels = (self._model, str(engine))
        drafts.labels(*labels).inc(stats.num_drafts - last.num_drafts)
        tokens.labels(*labels).inc(stats.num_draft_tokens - last.num_draft_tokens)
        accepted.labels(*labels).inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        for pos, (now, before) in enumerate(zip(stats.accepted_per_pos, last.accepted_per_pos)):
            per_pos.labels(*labels, str(pos)).inc(now - before)
        self._last[engine] = stats
