"""Incremental detokenization: a stream of generated token ids -> text deltas safe to emit.

Two layers, each holding back what it cannot vouch for yet:

1. `_TokenDecoder` turns ids into text with the prefix-offset / read-offset technique. It keeps
   a short window of ids and decodes it twice: `ids[prefix_offset:read_offset]` (text already
   emitted, used as context) and `ids[prefix_offset:]`; the delta is what the second adds to the
   first. Context matters because sentencepiece decoders render "▁Hello" as "Hello" at the start
   of a text and " Hello" after other text, and because one UTF-8 character may be split over
   several byte-level or `<0xE2>` byte-fallback tokens. While the window's text ends in U+FFFD
   (an incomplete character) nothing is emitted; once it is complete it is emitted whole.

       ids:   ... | p0  p1 | r0  r1  r2
                  ^prefix  ^read     ^len(ids)
                  `-------' context (already emitted, decoded for its effect on what follows)
                           `---------' pending: decoded but not yet emitted

   Each step decodes O(window) ids, and the window stays a few tokens long, so a step costs
   O(1) in the length of the output.

2. `IncrementalDetokenizer` watches the decoded text for stop strings and holds back the
   longest tail of it that could still grow into one, so a delta never contains text that later
   turns out to belong to a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmfleet.shared.core.errors import ValidationError

# Prompt tokens decoded as context before the first generated token.
_PROMPT_CONTEXT_TOKENS = 5
# A valid character is at most 4 bytes, and every non-special token decodes to at least one
# byte, so a window still ending in U+FFFD after this many pending tokens holds invalid bytes
# from the model; they are emitted as U+FFFD (what a full decode gives) to keep steps O(1).
_MAX_PENDING_TOKENS = 6
# Drop ids in front of the window once this many have piled up (keeps memory bounded).
_TRIM_IDS_AT = 1024

_REPLACEMENT_CHAR = "\ufffd"


def _skippable_special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` removes.

    Removing them before they reach the window is equivalent to skipping them in decode, and keeps
    a run of special tokens from widening the window.
    """
    candidates = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    candidates.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == "")


class _TokenDecoder:
    """Ids -> text deltas that never end inside a multi-byte character (see module docstring)."""

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = context_ids
        self._prefix_offset = 0
        self._read_offset = len(context_ids)
        self._prefix_text = self._decode(0, self._read_offset)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(
            _REPLACEMENT_CHAR
        )
        if complete or len(self._ids) - self._read_offset >= _MAX_PENDING_TOKENS:
            return self._advance(new_text)
        return ""

    def flush(self) -> str:
        """Emit whatever is pending, incomplete characters included (as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._prefix_offset, len(self._ids)))

    def _advance(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_IDS_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, applying stop strings.

    Invariants: `text` is the concatenation of every returned delta and only grows; it never
    contains a partial character unless the model produced invalid UTF-8, and never contains a
    stop string (unless `include_stop_str_in_output`, then exactly one, at its end). When several
    stop strings occur, the one whose last character comes first wins (the one a character-by-
    character scan would see first; ties go to the one starting earlier), so the result does not
    depend on how the text was split into tokens.

    One owner (the sequence's output loop) calls `add_tokens` for each batch of new ids and
    `finish` once when the sequence ends for a reason other than a stop string. Not thread-safe.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise ValidationError("stop", "must be a list of strings, not a single string")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValidationError(f"stop[{i}]", "must be a non-empty string")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._skipped_ids = (
            _skippable_special_ids(tokenizer) if skip_special_tokens else frozenset()
        )
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id not in self._skipped_ids:
                context.append(token_id)
                if len(context) == _PROMPT_CONTEXT_TOKENS:
                    break
        context.reverse()
        self._decoder = _TokenDecoder(tokenizer, context, skip_special_tokens)
        # Models often pad their vocabulary past the tokenizer's (e.g. to a multiple of 64);
        # such ids have no text, so they decode to nothing, as they would in HF `decode`.
        self._num_known_ids = len(tokenizer)
        # Decoded text not emitted yet: the longest tail that may still become a stop string.
        # Emitted text can never be part of a stop-string match, so a match lies inside
        # `_held` + the new text.
        self._held = ""
        self._emitted: list[str] = []
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None while none has matched."""
        return self._stop_reason

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; returns the new text that is safe to emit (maybe "")."""
        if self._finished:
            raise RuntimeError("add_tokens called after finish()")
        if self._stop_reason is not None:
            return ""
        new_text = "".join(
            self._decoder.step(t)
            for t in token_ids
            if t < self._num_known_ids and t not in self._skipped_ids
        )
        return self._emit(new_text, final=False)

    def add_tokens_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`add_tokens` one id at a time, stopping at the id that completes a stop string: the
        new text and how many of `token_ids` it used (all of them unless a stop string
        matched). A sequence then ends with that id, however many ids arrived together (a
        speculative step's, or several steps' joined)."""
        if len(token_ids) <= 1 or not self._stop:
            return self.add_tokens(token_ids), len(token_ids)
        text, used = "", 0
        for token_id in token_ids:
            if self._stop_reason is not None:
                break
            text += self.add_tokens((token_id,))
            used += 1
        return text, used

    def finish(self) -> str:
        """Flush held-back text and incomplete characters; call once when the sequence ends."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        if self._stop_reason is not None:
            return ""
        return self._emit(self._decoder.flush(), final=True)

    def _emit(self, new_text: str, *, final: bool) -> str:
        if not new_text and not final:
            return ""
        buf = self._held + new_text
        match = self._find_stop(buf, len(self._held))
        if match is not None:
            start, stop = match
            self._stop_reason = stop
            delta = buf[: start + len(stop)] if self._include_stop else buf[:start]
            self._held = ""
        else:
            num_held = 0 if final else self._partial_stop_len(buf)
            delta = buf[: len(buf) - num_held]
            self._held = buf[len(buf) - num_held :]
        if delta:
            self._emitted.append(delta)
        return delta

    def _find_stop(self, buf: str, num_old: int) -> tuple[int, str] | None:
        """The first-ending stop string in `buf` that uses some of `buf[num_old:]`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = buf.find(stop, max(0, num_old - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        if not buf:
            return 0
        last = buf[-1]
        best = 0
        for stop in self._stop:
            # Candidate prefixes stop[:k] end with `last`; try the longest first.
            k = stop.rfind(last, 0, min(len(stop) - 1, len(buf)))
            while k + 1 > best:
                if buf.endswith(stop[: k + 1]):
                    best = k + 1
                    break
                k = stop.rfind(last, 0, k)
        return best
