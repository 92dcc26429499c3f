"""A reasoning model's thinking, told apart from its answer (`--reasoning-parser`).

Models such as DeepSeek-R1 and Qwen3 think in a `<think>...</think>` block before they
answer. With a parser the server answers the block's text as `reasoning` (chat
completions' message and deltas) or a reasoning item (the Responses API), and only the rest
as the answer, which is also all that tool calls are read from. Two rules, vLLM's names:

- deepseek_r1: the text before the first `</think>` is reasoning (a leading `<think>` is
  dropped: R1's template opens the block in the prompt, and some models write it again);
  an output that never closes the block is all reasoning (cut while thinking).
- qwen3: reasoning only when the output opens with `<think>` (thinking mode), up to
  `</think>`; any other output is all answer (with `enable_thinking: false` the template
  puts an empty, closed block in the prompt).

Whitespace between `</think>` and the answer is dropped (templates write a blank line
there). Streamed, the text of a tag that may be arriving is held until it is told apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from launch.client.stop_strings import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
ReasoningParser = Literal["deepseek_r1", "qwen3"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningSplit:
    """One output's text, told apart as it arrives: feed() each delta, then finish()."""

    __slots__ = ("_open_tokens", "_pending", "_state", "parser", "reasoning_tokens")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        # "open": not yet known whether the output opens a block; "thinking"; "closed":
        # the block ended, whitespace before the answer is dropped; "answer".
        self._state = "open"
        self._pending = ""  # text held back
        self.reasoning_tokens = 0  # tokens of the reasoning (with the one that ends it)
        self._open_tokens = 0  # tokens fed while "open": reasoning if a block opens

    @property
    def thinking(self) -> bool:
        """Still inside the block, or not yet known whether one opens."""
        return self._state in ("open", "thinking")

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """(reasoning, answer) text that may go out after this delta of num_tokens."""
        before = self._state
        out = self._advance(text)
        if self._state == "open":
            self._open_tokens += num_tokens
        elif before == "open":
            if self._state != "answer":
                self.reasoning_tokens += self._open_tokens + num_tokens
            self._open_tokens = 0
        elif before == "thinking":
            self.reasoning_tokens += num_tokens
        return out

    def _advance(self, text: str) -> tuple[str, str]:
        if self._state == "answer":
            return "", text
        self._pending += text
        reasoning = ""
        if self._state == "open":
            head = self._pending.lstrip()
            if head.startswith(THINK_OPEN):
                self._pending = head[len(THINK_OPEN) :]
                self._state = "thinking"
            elif THINK_OPEN.startswith(head):
                return "", ""  # it may still open a block
            else:
                self._state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self._state == "thinking":
            end = self._pending.find(THINK_CLOSE)
            if end < 0:
                keep = partial_suffix(self._pending, (THINK_CLOSE,))
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._pending = self._pending[end + len(THINK_CLOSE) :]
            self._state = "closed"
        if self._state == "closed":
            self._pending = self._pending.lstrip()
            if not self._pending:
                return reasoning, ""
            self._state = "answer"
        answer, self._pending = self._pending, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """(reasoning, answer) of what was held back, once the output has ended."""
        held, self._pending = self._pending, ""
        if self._state == "open":
            self._state = "answer"
            if self.parser == "deepseek_r1":
                self.reasoning_tokens += self._open_tokens
                return held, ""
            return "", held
        return (held, "") if self._state == "thinking" else ("", held)


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, None when there is none; answer)."""
    s = ReasoningSplit(parser)
    r1, a1 = s.feed(text)
    r2, a2 = s.finish()
    return (r1 + r2) or None, a1 + a2


def language_start(encode: Callable[[str], list[int]], prompt: Sequence[int]) -> list[int] | None:
    """Where a structured output's language starts under a reasoning parser: after the
    tokens of `</think>` in the output (StructuredOutputs.start_after), or at once (None)
    when the prompt's last think block is closed already (thinking off: the template wrote
    an empty block). Exact for models whose tags are tokens of their own."""
    close = encode(THINK_CLOSE)
    if _last_at(prompt, close) > _last_at(prompt, encode(THINK_OPEN)):
        return None
    return close


def _last_at(ids: Sequence[int], seq: list[int]) -> int:
    """Where seq last occurs in ids, or -1."""
    n = len(seq)
    if not n:
        return -1
    first = seq[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and list(ids[i : i + n]) == seq:
            return i
    return -1
