"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's suffix.

For a sequence t[0:L] the proposer looks for the longest suffix n-gram, n from `ngram_max`
down to `ngram_min`, that also ends at some earlier position e < L (t[e-n:e] == t[L-n:L]), and
proposes t[e : e+k]; among occurrences of the same length the latest wins.

Cost per step is independent of the sequence's length: each request keeps an index from every
`ngram_min`-gram to the positions where it ends (ascending), extended by the tokens appended
since the last call; a lookup scans at most `max_candidates` of the latest occurrences of the
suffix's `ngram_min`-gram and extends each match backwards up to `ngram_max` tokens, so it is
O(max_candidates * ngram_max). (A longer match older than those candidates is not seen.)

Resuming after an inserted token: a model asked to copy or edit a text often adds a token the
text lacks (a comma, an article), after which no suffix longer than that one token matches and
the drafts would come from some unrelated occurrence of it. So when the best match is shorter
than `RESUME_MATCH` tokens, the proposer also matches the context before the last token
(at least `RESUME_MATCH` long, ending before it) and, when that match is longer, drafts what
followed the context there: the text as if the token had not been inserted. On the bench's
repeat and edit prompts this keeps about 5% more tokens a step (spec_decode_bench.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmfleet.engine.request import Request
from llmfleet.engine.spec_decode.proposer import Proposer

RESUME_MATCH = 2  # below this match length, also try the context before the last token


class _Index:
    """End positions of each `n`-gram of a sequence's first `indexed` tokens' n-grams."""

    __slots__ = ("ends", "indexed")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending at positions <= this one are in `ends`


class NgramProposer(Proposer):
    def __init__(
        self, ngram_min: int, ngram_max: int, *, max_candidates: int = 64, resume: bool = True
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_candidates = max_candidates
        self.resume = resume and ngram_max >= RESUME_MATCH  # after an inserted token
        self._index: dict[str, _Index] = {}

    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        return [self.lookup(req.request_id, req.all_token_ids, k) for req in reqs]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def lookup(self, key: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens following the best earlier match of `tokens`' suffix (see the
        module docstring); `key` names the sequence's index, which must only ever grow."""
        n, length = self.ngram_min, len(tokens)
        if k < 1 or length <= n:
            return []
        index = self._index.get(key)
        if index is None or index.indexed > length:
            index = self._index[key] = _Index()
        # Index the n-grams ending before the suffix's own end (so the suffix never matches
        # itself): end positions index.indexed + 1 .. length - 1.
        ends = index.ends
        for e in range(max(index.indexed + 1, n), length):
            gram = tuple(tokens[e - n : e])
            found = ends.get(gram)
            if found is None:
                ends[gram] = [e]
            else:
                found.append(e)
        index.indexed = max(index.indexed, length - 1)
        best_end, best_len = self._match(ends, tokens, length)
        if self.resume and best_len < RESUME_MATCH and length > n + 1:
            # The last token may be an insertion: match the context before it instead.
            end, m = self._match(ends, tokens, length - 1)
            if m >= RESUME_MATCH and m > best_len:
                return list(tokens[end : end + k])
        if best_len == 0:
            return []
        return list(tokens[best_end : best_end + k])

    def _match(
        self, ends: dict[tuple[int, ...], list[int]], tokens: Sequence[int], length: int
    ) -> tuple[int, int]:
        """(e, m): the longest match (m <= ngram_max, latest e among equals) of the suffix of
        tokens[:length] ending at some e < length; m = 0 when none."""
        n = self.ngram_min
        candidates = ends.get(tuple(tokens[length - n : length]))
        best_end, best_len = -1, 0
        if not candidates:
            return best_end, best_len
        scanned = 0
        for e in reversed(candidates):
            if e >= length:
                continue  # the suffix itself (matching the context before the last token)
            scanned += 1
            if scanned > self.max_candidates:
                break
            m = n  # the ngram_min tokens match; extend backwards
            while m < self.ngram_max and e - m > 0 and tokens[e - m - 1] == tokens[length - m - 1]:
                m += 1
            if m > best_len:
                best_end, best_len = e, m
                if m == self.ngram_max:
                    break
        return best_end, best_len
