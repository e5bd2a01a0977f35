"""The router's incremental detokenization: one tokenizer `Detokenize` stream for every
completion it streams, fed once per worker step for all of them.

    detok = Detokenizer(tokenizer_stub)             # one per router
    seq = DetokSequence(detok, trace_ctx, index)    # one per completion
    seq.open(prompt_ids, params)
    text, stop, used = await seq.feed(token_ids, finished)
    seq.close()

Protocol (tokenizer.proto): a request opens sequences, feeds open ones and closes them; a request
with feeds is answered by one response, its texts in feed order. Requests and answers keep their
order on the stream, so the answers are matched to the waiting feeds first in, first out.

Coalescing: what is opened, fed and closed in one turn of the event loop goes out as one request
(a flush scheduled with `call_soon`). A worker's `TokenBatch` wakes the tasks of all its
requests in one turn, so one engine step costs the router one detokenize round trip, not one per
completion. The stream is opened on first use, waiting for the tokenizer to be reachable
(`CONNECT_TIMEOUT_S`: a restarted tokenizer is waited for, not failed on); if it breaks, every
feed waiting on it and every sequence opened on it fails with `Unavailable` (those requests
end), and the next open starts a new stream.

Each completion has a `detokenize` span (child of its request's `llm_request`) from open to
close, with the number of tokens fed and whether a stop string matched.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.service import Unavailable, cancel_and_wait
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

Answer = asyncio.Future  # of a tokenizer_pb2.DetokenizedText

# How long a new stream waits for the tokenizer to be reachable. A channel that lost its
# tokenizer backs off before reconnecting, and a call started then would fail at once even
# though a restarted tokenizer (the supervisor's, within seconds) is serving again; so a
# stream waits for the channel to be ready, this long at most, then fails its feeds.
CONNECT_TIMEOUT_S = 10.0


class _Stream:
    """One open Detokenize call: a writer task sends queued requests in order, a reader task
    hands each response's texts to the feeds of the oldest request still unanswered."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, on_broken: Any) -> None:
        self.call = stub.Detokenize(wait_for_ready=True)
        self.outbox: asyncio.Queue[tuple[tokenizer_pb2.DetokenizeRequest, list[Answer]]] = (
            asyncio.Queue()
        )
        self.unanswered: deque[list[Answer]] = deque()
        self._on_broken = on_broken
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    async def _write(self) -> None:
        try:
            await asyncio.wait_for(self.call.wait_for_connection(), CONNECT_TIMEOUT_S)
            while True:
                request, answers = await self.outbox.get()
                if answers:
                    self.unanswered.append(answers)
                await self.call.write(request)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            self._on_broken(self, f"detokenize failed: {exc}")
        except TimeoutError:
            self._on_broken(self, f"not reachable within {CONNECT_TIMEOUT_S:g} s")

    async def _read(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    self._on_broken(self, "detokenize stream ended")
                    return
                answers = self.unanswered.popleft() if self.unanswered else []
                if len(answers) != len(response.texts):
                    self._on_broken(self, f"{len(response.texts)} texts for {len(answers)} feeds")
                    return
                for answer, text in zip(answers, response.texts, strict=True):
                    if not answer.done():
                        answer.set_result(text)
        except grpc.aio.AioRpcError as exc:
            self._on_broken(self, f"detokenize failed: {exc.details()}")

    def fail(self, why: str) -> None:
        """Cancel the call and fail every feed waiting on it."""
        self.call.cancel()
        for task in self._tasks:
            task.cancel()
        error = Unavailable(f"tokenizer: {why}")
        pending = list(self.unanswered)
        while not self.outbox.empty():
            pending.append(self.outbox.get_nowait()[1])
        for answers in pending:
            for answer in answers:
                if not answer.done():
                    answer.set_exception(error)

    async def close(self) -> None:
        self.call.cancel()
        for task in self._tasks:
            await cancel_and_wait(task)


class Detokenizer:
    """The router's one Detokenize stream (see the module docstring). Event-loop only."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._stub = stub
        self._ids = itertools.count(1)
        self._opens: dict[int, tokenizer_pb2.DetokenizeOpen] = {}  # not sent yet
        self._feeds: list[tokenizer_pb2.DetokenizeFeed] = []
        self._answers: list[Answer] = []
        self._closes: list[int] = []
        self._flush: asyncio.Handle | None = None
        self._stream: _Stream | None = None
        self._live: set[int] = set()  # opened on the current stream, neither closed nor finished
        self._lost: dict[int, str] = {}  # sequence -> why: its stream broke

    @property
    def num_sequences_lost(self) -> int:
        return len(self._lost)

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        sid = next(self._ids)
        self._opens[sid] = tokenizer_pb2.DetokenizeOpen(
            sequence_id=sid,
            prompt_token_ids=prompt_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self._schedule()
        return sid

    def feed(self, sid: int, token_ids: Sequence[int], finished: bool) -> Answer:
        """The answer (a `DetokenizedText`) to these new tokens of sequence `sid`."""
        answer: Answer = asyncio.get_running_loop().create_future()
        if sid in self._lost:
            answer.set_exception(Unavailable(f"tokenizer: {self._lost[sid]}"))
            return answer
        self._feeds.append(
            tokenizer_pb2.DetokenizeFeed(sequence_id=sid, token_ids=token_ids, finished=finished)
        )
        self._answers.append(answer)
        self._schedule()
        return answer

    def finished(self, sid: int) -> None:
        """Sequence `sid` was fed `finished` and answered: the tokenizer closed it itself."""
        self._live.discard(sid)

    def close(self, sid: int) -> None:
        """Drop a sequence that did not finish (aborted, stopped, or its stream broke)."""
        if self._opens.pop(sid, None) is not None or self._lost.pop(sid, None) is not None:
            return  # never sent, or gone with its stream
        if sid in self._live:
            self._live.discard(sid)
            self._closes.append(sid)
            self._schedule()

    async def close_stream(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.fail("the router is closing")
            await stream.close()

    def _schedule(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._flush = None
        request = tokenizer_pb2.DetokenizeRequest(
            opens=list(self._opens.values()), feeds=self._feeds, closes=self._closes
        )
        answers = self._answers
        if self._stream is None:
            self._stream = _Stream(self._stub, self._broken)
        self._live.update(self._opens)
        self._opens, self._feeds, self._answers, self._closes = {}, [], [], []
        self._stream.outbox.put_nowait((request, answers))

    def _broken(self, stream: _Stream, why: str) -> None:
        if stream is not self._stream:
            return
        logger.warning("tokenizer: %s; %d sequences lost", why, len(self._live))
        self._stream = None
        self._lost.update(dict.fromkeys(self._live, why))
        self._live = set()
        stream.fail(why)


class DetokSequence:
    """One completion's sequence on the router's Detokenizer, and its `detokenize` span."""

    def __init__(self, detok: Detokenizer, ctx: Context | None = None, index: int = 0) -> None:
        """`ctx`: the request's trace context; `index`: the completion this sequence is for."""
        self._detok = detok
        self._span = tracer.start_span(
            "detokenize", ctx, attributes={"llmfleet.completion_index": index}
        )
        self._sid: int | None = None
        self._finished = False  # the tokenizer closed the sequence itself (finished, or an error)
        self.closed = False
        self.num_tokens = 0
        self.stopped = False

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._sid = self._detok.open(prompt_ids, params)

    async def feed(self, token_ids: Sequence[int], finished: bool) -> tuple[str, str, int]:
        """Text to emit for these new tokens, the stop string if one matched, and how many of
        the tokens the text used (all of them, unless a stop string matched before the last)."""
        if self._sid is None:
            raise RuntimeError("feed before open")
        self.num_tokens += len(token_ids)
        text = await self._detok.feed(self._sid, token_ids, finished)
        if finished or text.error:
            self._finished = True
            self._detok.finished(self._sid)
        if text.error:
            raise Unavailable(f"tokenizer: detokenize failed: {text.error}")
        if not text.stop_string:
            return text.text, "", len(token_ids)
        self.stopped = True
        return text.text, text.stop_string, min(text.num_tokens or len(token_ids), len(token_ids))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._sid is not None and not self._finished:
            self._detok.close(self._sid)
        span = self._span
        if span.is_recording():
            span.set_attribute("llmfleet.detokenize.num_tokens", self.num_tokens)
            span.set_attribute("llmfleet.detokenize.stop_string_matched", self.stopped)
        span.end()
