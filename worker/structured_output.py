"""Structured outputs: a request's tokens kept inside a language, with llguidance.

Every worker rank keeps one matcher per constrained request (GrammarMatchers.add), advances
it with each token the request samples (GrammarMatchers.consume), and before a step
samples fills one bitmask row per constrained request (fill_bitmask): a set bit is a
token the language can continue with; once the language is complete only EOS is. The
ranks sample the same tokens, so their matchers agree without exchanging anything, and
the core never waits for a mask: the worker has each token as soon as it is sampled,
which is also why overlapped scheduling needs nothing more (a step planned ahead takes
its masks after its predecessor's tokens are in, in ModelRunner._finish_prepare).

grammar_of() turns the wire's StructuredOutputs into llguidance's grammar and checks it;
the launcher runs it at the boundary so a bad schema is the request's error, not the
worker's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from protocol.engine import StructuredOutputs

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("pagedserve.worker")

# What JSON may hold between two of its tokens: room for pretty-printing (a newline and
# 15 levels of two-space indentation), bounded, so a model that keeps choosing whitespace
# (some do, under an unbounded pattern) cannot spend a whole output on it.
JSON_WHITESPACE = r"[ \t\r\n]{0,32}"

# The built-in byte-level model's tokenizer description (no tokenizer.json): launch/
# writes and reads it too.
BYTE_TOKENIZER_FILE = "pagedserve_tokenizer.json"


def read_byte_tokenizer(directory: str | Path) -> tuple[int, int] | None:
    """(bos, eos) of a byte tokenizer description in the model directory, or None."""
    marker = Path(directory) / BYTE_TOKENIZER_FILE
    if not marker.exists():
        return None
    try:
        spec = json.loads(marker.read_text())
        return int(spec["bos_token_id"]), int(spec["eos_token_id"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{marker}: malformed byte tokenizer description: {e}") from None


def grammar_of(spec: StructuredOutputs) -> str:
    """llguidance's grammar for spec; ValueError naming what is wrong with it."""
    spec.validate()
    return _grammar(msgspec.msgpack.encode(spec))


@lru_cache(maxsize=256)
def _grammar(key: bytes) -> str:
    # Clients send the same few schemas over and over: each is converted and checked once.
    from llguidance import LLMatcher

    spec = msgspec.msgpack.decode(key, type=StructuredOutputs)
    kind = spec.kind()
    options: dict[str, object] = (
        {"whitespace_flexible": False}
        if spec.disable_any_whitespace
        else {"whitespace_pattern": JSON_WHITESPACE}
    )
    try:
        if kind == "json" or kind == "json_object":
            schema = spec.json if spec.json is not None else '{"type": "object"}'
            if not isinstance(msgspec.json.decode(schema), dict):
                raise ValueError("a JSON Schema is a JSON object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "regex":
            assert spec.regex is not None
            grammar = LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            assert spec.choice is not None
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            )
        else:
            from llguidance import grammar_from

            assert spec.grammar is not None
            grammar = grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted
    except (ValueError, msgspec.DecodeError) as e:
        raise ValueError(f"structured_outputs {kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"structured_outputs {kind}: {error.strip()}")
    return grammar


def grammar_tokenizer(
    model_dir: str | Path, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance needs it (the bytes of every token), from its
    tokenizer.json or the byte tokenizer's description. EOS: the ids that end a request."""
    from llguidance import LLTokenizer, TokenizerWrapper

    directory = Path(model_dir)
    eos = list(eos_token_ids)
    if (directory / "tokenizer.json").exists():
        return LLTokenizer((directory / "tokenizer.json").read_text(), eos_token=eos)
    byte = read_byte_tokenizer(directory)
    if byte is None:
        raise ValueError(
            f"model {directory} has no tokenizer (tokenizer.json): structured outputs need one"
        )
    return LLTokenizer(TokenizerWrapper(_ByteTokens(*byte)), eos_token=eos)


class _ByteTokens:
    """What llguidance reads of a tokenizer, for the byte tokenizer: token i < 256 is
    byte i; BOS and EOS follow as special tokens."""

    def __init__(self, bos: int, eos: int) -> None:
        self.bos_token_id = bos
        self.eos_token_id = eos
        self.special_token_ids = [bos, eos]
        names = {bos: b"<s>", eos: b"</s>"}
        self.tokens = [
            bytes([i]) if i < 256 else names.get(i, b"") for i in range(max(bos, eos) + 1)
        ]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarMatchers:
    """The matchers of one worker's constrained requests, by request id.

    A matcher is compiled on a thread of its own (llguidance lets go of the GIL while it
    builds one; a large schema takes tens of milliseconds, the tokenizer's trie ~0.3 s
    the first time) while the request's prompt runs, and waited for only when its first
    token is sampled. A request whose spec does not compile (the launcher checks them; a
    client speaking the core's protocol directly may not), or a model without a
    tokenizer, gets no matcher (None): it may only end, with EOS, at once.

    A spec with start_after waits: its request samples freely, and its matcher follows
    nothing, until the output ends with those tokens (a reasoning model's end of
    thinking); the language starts with the next token."""

    def __init__(self, model_dir: str | Path, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiler: ThreadPoolExecutor | None = None
        self.matchers: dict[str, llguidance.LLMatcher | Future | None] = {}
        # Requests whose language has not started: (the marker, the output's last tokens).
        self.waiting: dict[str, tuple[tuple[int, ...], list[int]]] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.matchers[req_id] = self._compiler.submit(self._compile, req_id, spec)
        if spec.start_after:
            self.waiting[req_id] = (tuple(spec.start_after), [])

    def _compile(self, req_id: str, spec: StructuredOutputs) -> llguidance.LLMatcher | None:
        from llguidance import LLMatcher

        matcher: LLMatcher | None = None
        try:
            if self._tokenizer is None:  # one compiler thread: no race
                self._tokenizer = grammar_tokenizer(self.model_dir, self.eos_token_ids)
            matcher = LLMatcher(self._tokenizer, grammar_of(spec), log_level=0)
            error = matcher.get_error() if matcher.is_error() else None
        except Exception as e:  # whatever the library raises ends this request alone
            matcher, error = None, f"{type(e).__name__}: {e}"
        if error is not None:
            log.warning("request %r: bad structured output (%s); it ends at once", req_id, error)
        return matcher

    def _ready(self, req_id: str) -> llguidance.LLMatcher | None:
        m = self.matchers[req_id]
        if isinstance(m, Future):
            m = self.matchers[req_id] = m.result()
        return m

    def drop(self, req_id: str) -> None:
        self.waiting.pop(req_id, None)
        m = self.matchers.pop(req_id, None)
        if isinstance(m, Future):
            m.cancel()

    def consume(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """Advance each constrained request by the token it sampled."""
        matchers, waiting = self.matchers, self.waiting
        for req_id, token in zip(req_ids, token_ids):
            if waiting and req_id in waiting:
                marker, tail = waiting[req_id]
                tail.append(token)
                del tail[: -len(marker)]
                if tuple(tail) == marker:
                    del waiting[req_id]  # the language starts with the next token
                continue
            m = matchers.get(req_id)
            if isinstance(m, Future):  # not sampled yet: nothing to follow
                continue
            # A stopped matcher has seen EOS: its request has ended, and a token a step
            # planned ahead sampled for it anyway is dropped by the core.
            if m is not None and not m.is_stopped() and not m.consume_token(token):
                log.warning(
                    "request %r: token %d is outside its structured output (%s)",
                    req_id,
                    token,
                    m.get_error(),
                )

    def fill_bitmask(self, req_ids: Sequence[str]) -> tuple[list[int], np.ndarray] | None:
        """(the indices in req_ids of the constrained requests, their allowed-token
        bitmasks as int32 words: bit j of word w is token 32 * w + j), or None when no
        request is constrained. Tokens past the bitmask's width are not allowed."""
        matchers, waiting = self.matchers, self.waiting
        found = [
            (i, self._ready(r)) for i, r in enumerate(req_ids) if r in matchers and r not in waiting
        ]
        if not found:
            return None
        tok = self._tokenizer
        width = tok.vocab_size if tok is not None else max(self.eos_token_ids) + 1
        words = np.zeros((len(found), (width + 31) // 32), dtype=np.int32)
        live = [(m, k) for k, (_, m) in enumerate(found) if m is not None and not m.is_error()]
        if live:
            # One row at a time on this thread: llguidance's parallel fill keeps its thread
            # pool spinning after, which took the CPU worker's cores from the model (the
            # built-in model's JSON run: 0.69 of free generation, 0.88 this way).
            row_bytes = words.shape[1] * 4
            base = words.ctypes.data
            for m, k in live:
                m.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        if len(live) < len(found):
            bits = words.view(np.uint32)
            for k, (_, m) in enumerate(found):
                if m is None or m.is_error():
                    bits[k] = 0
                    for t in self.eos_token_ids:
                        bits[k, t // 32] |= np.uint32(1 << (t % 32))
        return [i for i, _ in found], words
