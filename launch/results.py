"""The output file of `pagedserve generate`: durable as results come, in input order at the end.

Lines go through JsonLinesOutput (launch/output_file.py): an existing file is kept until
the engine is up, and each result is one complete line appended the moment its request
ends, so Ctrl-C, SIGTERM, SIGKILL or a dead engine keep every finished result. A run that
ends normally rewrites the file in input order (atomically: a crash mid-rewrite leaves the
old file), a prompt's n copies one after the other in seq_index order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from launch.output_file import JsonLinesOutput
from protocol.engine import Logprobs, SamplingParams

MAX_LISTED_ERRORS = 20


class ResultWriter:
    def __init__(self, path: Path) -> None:
        """Open path without truncating it (start() does, once the engine is up); OSError
        names the path when it cannot be written."""
        self.path = path
        self.output = JsonLinesOutput(path)
        self._open = True
        self._encoder = msgspec.json.Encoder()
        self.written = 0
        self.failed = 0
        self.errors: list[str] = []  # the first MAX_LISTED_ERRORS, for the summary

    def write(self, index: int, out: Any, params: SamplingParams | None = None) -> None:
        """Append one result (a CompletionOutput) as line `index` of the input. params, the
        request's: keys for what its options produce (seq_index when n > 1, stop_reason
        with stop strings) appear only when it asked for them, so plain lines keep the
        format older readers know."""
        line: dict[str, Any] = {
            "index": index,
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "num_cached_tokens": out.num_cached_tokens,
        }
        copies = params is not None and params.n > 1
        if copies:
            line["seq_index"] = out.seq_index
        if out.text is not None:
            line["text"] = out.text
        if params is not None and params.stop and out.finish_reason != "error":
            line["stop_reason"] = out.stop_reason
        if out.logprobs is not None:
            line["logprobs"] = [_logprob_object(lp) for lp in out.logprobs]
        if out.prompt_logprobs is not None:
            line["prompt_logprobs"] = [
                None if lp is None else _logprob_object(lp) for lp in out.prompt_logprobs
            ]
        if out.error is not None:
            line["error"] = out.error
        self.output.write(self._encoder.encode(line))
        self.written += 1
        if out.finish_reason == "error":
            self.failed += 1
            if len(self.errors) < MAX_LISTED_ERRORS:
                which = f"request {index} (copy {out.seq_index})" if copies else f"request {index}"
                self.errors.append(f"{which} failed: {out.error}")

    def start(self) -> None:
        """The engine is up: the file is emptied and takes results from now on."""
        self.output.start()

    def close(self, sort: bool) -> None:
        """Close the file; sort=True rewrites it in input order first (a regular file only:
        a pipe or standard output keeps completion order). OutputWriteError when the
        rewrite cannot be written (the file then still holds every result, unsorted)."""
        if not self._open:
            return
        self._open = False
        decoder = msgspec.json.Decoder()

        # Copies of one prompt (n > 1) finish in any order; seq_index puts them back.
        def order(_position: int, raw: bytes) -> tuple[int, int]:
            line = decoder.decode(raw)
            return line["index"], line.get("seq_index", 0)

        self.output.close(order if sort else None)


def _logprob_object(lp: Logprobs) -> dict[str, Any]:
    # An object, not msgspec's positional array: the file is read by other programs.
    return {
        "logprob": lp.logprob,
        "top_token_ids": lp.top_token_ids,
        "top_logprobs": lp.top_logprobs,
    }
