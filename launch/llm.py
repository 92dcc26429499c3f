"""The Python API: `from launch import LLM, SamplingParams`."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from launch.engine import EngineArgs, EngineDeadError, EngineProcesses
from launch.tokenizer import Tokenizer, load_tokenizer
from protocol.engine import SamplingParams, SchedulerStats


@dataclass
class CompletionOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class Prompt:
    """One input: text or token ids, with optional per-request settings."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    cache_salt: str | None = None


@dataclass
class RunSummary:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    stats: SchedulerStats | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        s = self.stats
        return s.prefix_cache_hits / s.prefix_cache_queries if s and s.prefix_cache_queries else 0.0


class LLM:
    """An engine (core + workers) for offline generation. With no model, the built-in
    small random Llama runs offline."""

    def __init__(self, model: str | None = None, *, log_level: str = "WARNING", **kwargs: Any):
        from worker.model_config import load_model_config  # fails fast, naming the file

        if model is None:
            from launch.builtin_model import builtin_model_dir

            model = str(builtin_model_dir())
        model_config = load_model_config(model)
        self.eos_token_id = model_config.eos_token_ids[0] if model_config.eos_token_ids else None
        self.tokenizer: Tokenizer | None = load_tokenizer(model, self.eos_token_id)
        self.engine = EngineProcesses(EngineArgs(model=model, **kwargs), log_level=log_level)
        self.vocab_size = self.engine.ready.vocab_size
        self.last_summary = RunSummary()
        self.dead_reason: str | None = None  # set once the engine has stopped
        self._next_id = 0

    def generate(
        self,
        prompts: list[str | list[int] | Prompt],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Outputs in input order; a bad prompt fails alone (finish_reason "error")."""
        default = sampling_params or SamplingParams()
        results: list[CompletionOutput] = []
        pending: dict[str, int] = {}
        summary = RunSummary(requests=len(prompts))
        start = time.perf_counter()
        for index, item in enumerate(prompts):
            p = (
                item
                if isinstance(item, Prompt)
                else (
                    Prompt(prompt=item) if isinstance(item, str) else Prompt(prompt_token_ids=item)
                )
            )
            out = CompletionOutput(index=index, prompt_token_ids=[])
            results.append(out)
            try:
                ids = self._token_ids(p)
            except ValueError as e:
                out.finish_reason, out.error = "error", str(e)
                continue
            out.prompt_token_ids = ids
            summary.prompt_tokens += len(ids)
            rid = f"req-{self._next_id}"
            self._next_id += 1
            pending[rid] = index
            self.engine.add_request(rid, ids, p.sampling_params or default, p.cache_salt)
        bar = _progress(len(prompts), use_tqdm)
        bar.update(len(prompts) - len(pending))
        try:
            while pending:
                batch = self.engine.get_outputs()
                if batch is None:
                    continue
                if batch.stats is not None:
                    summary.stats = batch.stats
                for o in batch.outputs:
                    index = pending.get(o.request_id)
                    if index is None:
                        continue
                    out = results[index]
                    out.token_ids.extend(o.new_token_ids)
                    summary.output_tokens += len(o.new_token_ids)
                    if o.finish_reason is not None:
                        out.finish_reason = o.finish_reason
                        out.num_cached_tokens = o.num_cached_tokens
                        out.error = o.error
                        del pending[o.request_id]
                        bar.update(1)
        except KeyboardInterrupt:
            self.engine.abort(list(pending))
            raise
        except EngineDeadError as e:
            # The core fails the requests it knows of before it stops; any it never read
            # fail here with the same reason, so every input still gets its answer.
            self.dead_reason = str(e)
            for index in pending.values():
                results[index].finish_reason, results[index].error = "error", str(e)
        finally:
            bar.close()
        summary.seconds = time.perf_counter() - start
        summary.failed = sum(1 for r in results if r.finish_reason == "error")
        if summary.failed and self.dead_reason is None:
            # Failures may be the engine going down: say so rather than look healthy.
            self.dead_reason = self.engine.dead_reason()
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids)
        self.last_summary = summary
        return results

    def _token_ids(self, p: Prompt) -> list[int]:
        if (p.prompt is None) == (p.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if p.prompt_token_ids is not None:
            return list(p.prompt_token_ids)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: give prompt_token_ids")
        return self.tokenizer.encode(p.prompt)  # type: ignore[arg-type]

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, file=sys.stderr)


__all__ = ["LLM", "CompletionOutput", "EngineDeadError", "Prompt", "SamplingParams"]
