"""Streaming text: the text a request's new tokens add, one output at a time.

A token can end in the middle of a UTF-8 character (byte-level tokenizers split them),
and some tokenizers decode a token differently at the start of a text than after
another (leading spaces, word joins). So each delta is the difference between two
decodes of a short window, and held back while the window ends in U+FFFD, the mark of an
incomplete character. The deltas of a finished request add up to the decode of all its
tokens; each decode costs a few tokens, not the whole output.
"""

from __future__ import annotations

from launch.client.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        # token_ids[prefix:read] is the context already turned into text; [read:] is new.
        self._prefix = 0
        self._read = 0

    def step(self, new_token_ids: list[int]) -> str:
        """The text new_token_ids complete ("" while a character is unfinished)."""
        self.token_ids.extend(new_token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back, unfinished characters as U+FFFD."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        ids = self.token_ids
        if self._read == len(ids):
            return ""
        decode, skip = self._tokenizer.decode, self._skip
        before = decode(ids[self._prefix : self._read], skip) if self._read > self._prefix else ""
        text = decode(ids[self._prefix :], skip)
        if not final and text.endswith(REPLACEMENT):
            return ""
        if len(text) <= len(before):
            # A token that adds no text yet (e.g. a special token decoded as nothing).
            if final:
                self._read = len(ids)
            return ""
        self._prefix, self._read = self._read, len(ids)
        return text[len(before) :]
