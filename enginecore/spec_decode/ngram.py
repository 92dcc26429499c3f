"""Prompt lookup (n-gram) drafts: find the request's last tokens earlier in its own
tokens and propose what followed them there.

An incremental index keeps, for every n-gram of the shortest looked-up length, the
positions right after its latest occurrences, so a step costs a dictionary lookup and a
few short comparisons, not a scan of the request's tokens."""

from __future__ import annotations

# Occurrences remembered per n-gram (the latest ones): a token run repeated hundreds
# of times would otherwise make each lookup compare against all of them.
MAX_CANDIDATES = 8


class NgramIndex:
    """One request's n-gram index over its tokens, extended as tokens arrive."""

    __slots__ = ("_indexed", "_max", "_min", "_positions", "match_length")

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self._min = lookup_min
        self._max = lookup_max
        # n-gram of lookup_min tokens -> end positions (exclusive) of its latest
        # occurrences that some token follows, oldest first.
        self._positions: dict[tuple[int, ...], list[int]] = {}
        self._indexed = lookup_min - 1  # n-grams ending before this are indexed
        self.match_length = 0  # tokens the last propose() matched (0: none)

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        n, positions = self._min, self._positions
        for end in range(self._indexed + 1, len(tokens)):
            key = tuple(tokens[end - n : end])
            found = positions.get(key)
            if found is None:
                positions[key] = [end]
            else:
                found.append(end)
                if len(found) > MAX_CANDIDATES:
                    del found[0]
        if len(tokens) > self._indexed + 1:
            self._indexed = len(tokens) - 1

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match (at least lookup_min,
        at most lookup_max tokens) of the tokens' tail; a tie goes to the match followed by
        more tokens, then to the latest."""
        self._extend(tokens)
        self.match_length = 0
        n, num = self._min, len(tokens)
        if num <= n or k < 1:
            return []
        found = self._positions.get(tuple(tokens[num - n :]))
        if not found:
            return []
        best_end, best = -1, (0, 0)
        longest = min(self._max, num - 1)
        for end in reversed(found):
            length = n
            # Extend the match leftwards, up to lookup_max tokens.
            while (
                length < longest
                and end - length - 1 >= 0
                and tokens[end - length - 1] == tokens[num - length - 1]
            ):
                length += 1
            # Longest match first; then the one followed by more tokens (a token
            # repeated at the very end has only itself after its latest match).
            score = (length, min(k, num - end))
            if score > best:
                best_end, best = end, score
                if score == (longest, k):
                    break
        self.match_length = best[0]
        return tokens[best_end : best_end + k]
