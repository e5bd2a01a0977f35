"""How `llmfleet generate` prints completions: their text on stdout in index order, each
`--logprobs` record as one JSON line on stderr (the output format is in `parser`'s epilog)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import IO, Any


class CompletionPrinter:
    """Writes completions to `out` in index order as their text arrives (see the epilog).

    Text of the completion being printed goes out at once; text of later ones is held until
    every earlier one has finished, so streamed output equals the non-streamed output.
    """

    def __init__(self, n: int, out: IO[str], err: IO[str]) -> None:
        self._n = max(n, 1)
        self._out = out
        self._err = err
        self._held: list[list[str]] = [[] for _ in range(self._n)]
        self._done = [False] * self._n
        self._positions = [0] * self._n
        self._current = 0
        self._opened = False

    def add(self, index: int, text: str, *, finished: bool, logprobs: Iterable[Any] = ()) -> None:
        for lp in logprobs:
            if lp is not None:
                self._write_logprobs(index, lp)
        if not 0 <= index < self._n:
            return
        if index == self._current:
            self._open()
            self._out.write(text)
        else:
            self._held[index].append(text)
        self._done[index] = self._done[index] or finished
        while self._current < self._n and self._done[self._current]:
            self._open()
            self._out.write("\n")
            self._current += 1
            self._opened = False
        if self._current < self._n and self._held[self._current]:
            self._open()  # writes the next completion's held text
        self._out.flush()

    def close(self) -> None:
        """End the output (the stream ended, maybe early): flush held text, end the line."""
        for i in range(self._current, self._n):
            self.add(i, "", finished=True)

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            if self._n > 1:
                self._out.write(f"--- completion {self._current} ---\n")
            if self._held[self._current]:
                self._out.write("".join(self._held[self._current]))
                self._held[self._current].clear()

    def _write_logprobs(self, index: int, lp: Any) -> None:
        record = {
            "completion": index,
            "position": self._positions[index] if 0 <= index < self._n else None,
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "rank": lp.rank,
            "top": [
                {"token_id": t, "logprob": v}
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        }
        if 0 <= index < self._n:
            self._positions[index] += 1
        self._err.write(json.dumps(record) + "\n")
        self._err.flush()
