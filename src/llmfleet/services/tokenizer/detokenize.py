"""The sequences of one Detokenize stream (tokenizer.proto): each an `IncrementalDetokenizer`.

    session = DetokenizeSession(tokenizer, vocab_size)
    response = session.apply(request)      # None when the request fed nothing

A request's opens are applied first, then its feeds in order (each answered by one
`DetokenizedText`), then its closes. Errors belong to one sequence: a refused open is reported
on that sequence's first feed, a refused feed in its own answer, and either closes the
sequence; the stream and its other sequences go on. A feed with `finished` flushes held-back
text and closes the sequence. Once a stop string matched, every later answer of the sequence
carries it (and no text). Per-stream state only; not thread-safe (one stream, one task).
"""

from __future__ import annotations

from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.text.detokenizer import IncrementalDetokenizer
from llmfleet.v1 import tokenizer_pb2

# Generated ids may lie past the tokenizer's vocabulary (a model's padding rows); they decode
# to no text. Only negative ids, or ids past any vocabulary, are malformed.
MAX_TOKEN_ID = 1 << 31


def check_ids(ids: Any, vocab_size: int, field: str) -> list[int]:
    out = list(ids)
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise ValidationError(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})"
            )
    return out


class DetokenizeSession:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._open: dict[int, IncrementalDetokenizer] = {}
        self._refused: dict[int, str] = {}  # sequence id -> why its open was refused

    @property
    def num_open(self) -> int:
        return len(self._open)

    def apply(
        self, request: tokenizer_pb2.DetokenizeRequest
    ) -> tokenizer_pb2.DetokenizeResponse | None:
        for op in request.opens:
            self._start(op)
        response = None
        if request.feeds:
            response = tokenizer_pb2.DetokenizeResponse()
            for feed in request.feeds:
                response.texts.append(self._feed(feed))
        for sid in request.closes:
            self._open.pop(sid, None)
            self._refused.pop(sid, None)
        return response

    def _start(self, op: tokenizer_pb2.DetokenizeOpen) -> None:
        sid = op.sequence_id
        try:
            if sid in self._open or sid in self._refused:
                raise ValidationError("opens.sequence_id", f"sequence {sid} is already open")
            prompt = check_ids(op.prompt_token_ids, self._vocab_size, "opens.prompt_token_ids")
            skip = op.skip_special_tokens if op.HasField("skip_special_tokens") else True
            try:
                self._open[sid] = IncrementalDetokenizer(
                    self._tokenizer,
                    prompt,
                    skip_special_tokens=skip,
                    stop=list(op.stop),
                    include_stop_str_in_output=op.include_stop_str_in_output,
                )
            except ValidationError as exc:
                raise ValidationError(f"opens.{exc.field}", exc.message) from None
        except ValidationError as exc:
            self._open.pop(sid, None)
            self._refused[sid] = str(exc)

    def _feed(self, feed: tokenizer_pb2.DetokenizeFeed) -> tokenizer_pb2.DetokenizedText:
        sid = feed.sequence_id
        out = tokenizer_pb2.DetokenizedText(sequence_id=sid)
        detok = self._open.get(sid)
        if detok is None:
            out.error = self._refused.pop(sid, f"feeds.sequence_id: sequence {sid} is not open")
            return out
        try:
            ids = check_ids(feed.token_ids, MAX_TOKEN_ID, "feeds.token_ids")
        except ValidationError as exc:
            del self._open[sid]
            out.error = str(exc)
            return out
        text, used = detok.add_tokens_until_stop(ids)
        if feed.finished:
            text += detok.finish()
            del self._open[sid]
        out.text = text
        out.stop_string = detok.stop_reason or ""
        if out.stop_string:
            out.num_tokens = used
        return out
