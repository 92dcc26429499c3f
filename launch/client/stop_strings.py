"""Stop strings, matched on a request's streamed text (the output of
launch.client.detokenizer.IncrementalDetokenizer, so never half a character).

Text that could still be the start of a stop string is held back until the next delta
settles it, so a stream never shows text that a later match would have cut: the text a
request streams is exactly its final text, which ends before the first stop string. A
match never starts in text that the first min_tokens tokens produced (those tokens cannot
end the request: the same rule as EOS and stop_token_ids).
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_suffix(text: str, targets: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of targets:
    text a stream must hold back until the next delta tells whether a target follows."""
    best = 0
    for s in targets:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], min_tokens: int = 0, include: bool = False) -> None:
        """include: the text released at a match ends with the stop string (vLLM's
        include_stop_str_in_output), not before it."""
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include = include
        self._held = ""  # text not yet released: a suffix that may begin a stop string
        self.matched: str | None = None  # the stop string found, once it is

    def step(self, text: str, num_output_tokens: int) -> str:
        """The text that is safe to release, given the delta text that the request's
        first num_output_tokens tokens completed. After a match (self.matched is set) it
        is the text before the stop string, and the request is over."""
        if self.matched is not None:
            return ""
        if num_output_tokens <= self.min_tokens:
            return text  # nothing may stop the request yet, nor start a match
        buf = self._held + text
        if not buf:
            return ""
        first = -1
        for s in self.stop:
            at = buf.find(s)
            if at >= 0 and (first < 0 or at < first):
                first, self.matched = at, s
        if first >= 0:
            self._held = ""
            assert self.matched is not None
            return buf[: first + len(self.matched)] if self.include else buf[:first]
        keep = partial_suffix(buf, self.stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end without a match: the text still held back."""
        held, self._held = self._held, ""
        return held
