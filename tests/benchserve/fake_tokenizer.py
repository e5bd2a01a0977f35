"""A tiny deterministic tokenizer for dataset tests (the `datasets.Tokenizer` protocol).

ids 0..25 are the letters a..z, 26 a space, 27 the merge "ab" (so decode/encode does not always
round trip: [0, 1] decodes to "ab", which encodes to [27]), 28 a special token never sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

LETTERS = "abcdefghijklmnopqrstuvwxyz "
MERGE_ID = 27
SPECIAL_ID = 28


class FakeTokenizer:
    def __init__(self, merges: bool = True) -> None:
        self.merges = merges

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if self.merges and text.startswith("ab", i):
                out.append(MERGE_ID)
                i += 2
            else:
                out.append(LETTERS.index(text[i]))
                i += 1
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join("ab" if i == MERGE_ID else LETTERS[i] for i in ids)

    def sampleable_ids(self) -> list[int]:
        return list(range(MERGE_ID + 1 if self.merges else MERGE_ID))
