"""Suffix decoding's drafts: the longest match of a request's tail, first in its own
tokens, then in the outputs of recently finished requests (agents and chats repeat
earlier answers), with more drafts for a longer match.

Memory is bounded: each open request keeps one n-gram index over its own tokens, and
at most suffix_decoding_max_cached_requests finished outputs are indexed (the oldest
goes first)."""

from __future__ import annotations

import math
from collections import OrderedDict

from enginecore.spec_decode.ngram import MAX_CANDIDATES, NgramIndex
from protocol.speculative import SpeculativeConfig

# The shortest tail matched when the flag names no prompt_lookup_min.
DEFAULT_MIN_MATCH = 2


class SuffixCache:
    def __init__(self, config: SpeculativeConfig) -> None:
        self._min = config.prompt_lookup_min or DEFAULT_MIN_MATCH
        self._depth = max(config.suffix_decoding_max_tree_depth, self._min)
        self._factor = config.suffix_decoding_max_spec_factor
        self._capacity = config.suffix_decoding_max_cached_requests
        self._own: dict[str, NgramIndex] = {}
        # Finished outputs, oldest first, and an index of their n-grams of _min tokens:
        # n-gram -> (output id, end position) of its latest occurrences.
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._next_id = 0

    def _limit(self, match_length: int, k: int) -> int:
        """Drafts a match of match_length tokens may propose."""
        return min(k, max(1, math.ceil(match_length * self._factor)))

    def propose(self, request_id: str, tokens: list[int], num_prompt: int, k: int) -> list[int]:
        own = self._own.get(request_id)
        if own is None:
            own = self._own[request_id] = NgramIndex(self._min, self._depth)
        drafts = own.propose(tokens, k)
        if drafts:
            return drafts[: self._limit(own.match_length, k)]
        return self._from_outputs(tokens, k)

    def _from_outputs(self, tokens: list[int], k: int) -> list[int]:
        n, num = self._min, len(tokens)
        if num < n or not self._index:
            return []
        found = self._index.get(tuple(tokens[num - n :]))
        if not found:
            return []
        outputs = self._outputs
        best: list[int] = []
        best_end = best_len = 0
        for output_id, end in reversed(found):
            out = outputs.get(output_id)
            if out is None:
                continue  # evicted; pruned when its n-gram is next indexed
            length = n
            while (
                length < self._depth
                and length < num
                and end - length - 1 >= 0
                and out[end - length - 1] == tokens[num - length - 1]
            ):
                length += 1
            if length > best_len:
                best, best_end, best_len = out, end, length
        return best[best_end : best_end + self._limit(best_len, k)]

    def finish(self, request_id: str, tokens: list[int], num_prompt: int) -> None:
        """Forget the request's own index; remember its output for later requests."""
        self._own.pop(request_id, None)
        output = tokens[num_prompt:]
        if self._capacity == 0 or len(output) <= self._min:
            return
        while len(self._outputs) >= self._capacity:
            self._evict()
        output_id = self._next_id
        self._next_id += 1
        self._outputs[output_id] = output
        n, index, outputs = self._min, self._index, self._outputs
        for end in range(n, len(output)):
            key = tuple(output[end - n : end])
            found = index.get(key)
            if found is None:
                index[key] = [(output_id, end)]
                continue
            found[:] = [c for c in found if c[0] in outputs]
            found.append((output_id, end))
            if len(found) > MAX_CANDIDATES:
                del found[0]

    def _evict(self) -> None:
        """Drop the oldest output and its index entries."""
        output_id, output = self._outputs.popitem(last=False)
        n, index = self._min, self._index
        for end in range(n, len(output)):
            key = tuple(output[end - n : end])
            found = index.get(key)
            if found is None:
                continue
            found[:] = [c for c in found if c[0] != output_id]
            if not found:
                del index[key]
