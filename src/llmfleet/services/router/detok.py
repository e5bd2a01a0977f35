"""One tokenizer `Detokenize` stream per completion.

Protocol (tokenizer.proto): a `start` message (no answer), then one `tokens` message per engine
step, each answered by exactly one response with the text safe to emit and, once matched, the
stop string. `open` only starts writing the start message: the request goes on to its worker
meanwhile (the write is off the TTFT path), and the first `feed` waits for it.

Each stream is one `detokenize` span (child of the request's `llm_request`), from the stream's
creation to `close`, with the number of tokens fed and whether a stop string matched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

tracer = trace.get_tracer(__name__)


class DetokStream:
    def __init__(
        self, stub: tokenizer_pb2_grpc.TokenizerStub, ctx: Context | None = None, index: int = 0
    ) -> None:
        """`ctx`: the request's trace context; `index`: the completion this stream is for."""
        self._span = tracer.start_span(
            "detokenize", ctx, attributes={"llmfleet.completion_index": index}
        )
        self._call = stub.Detokenize(metadata=metadata(trace.set_span_in_context(self._span, ctx)))
        self.closed = False
        self.num_tokens = 0
        self.stopped = False
        self._opening: asyncio.Task[None] | None = None

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Start writing the start message (in the background; `feed` waits for it)."""
        start = tokenizer_pb2.DetokenizeStart(
            prompt_token_ids=prompt_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        task = asyncio.ensure_future(self._write(tokenizer_pb2.DetokenizeRequest(start=start)))
        task.add_done_callback(_consume)  # a failure surfaces at the first feed
        self._opening = task

    async def feed(self, token_ids: Sequence[int], finished: bool) -> tuple[str, str]:
        """Text to emit for these new tokens, and the stop string if one matched."""
        if self._opening is not None:
            opening, self._opening = self._opening, None
            await opening
        msg = tokenizer_pb2.DetokenizeRequest(
            tokens=tokenizer_pb2.DetokenizeTokens(token_ids=token_ids, finished=finished)
        )
        self.num_tokens += len(token_ids)
        await self._write(msg)
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"tokenizer: detokenize failed: {exc.details()}") from None
        if resp is grpc.aio.EOF:
            raise Unavailable("tokenizer: detokenize stream ended early")
        if resp.stop_string:
            self.stopped = True
        return resp.text, resp.stop_string

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._opening is not None:
                self._opening.cancel()
            self._call.cancel()
            span = self._span
            if span.is_recording():
                span.set_attribute("llmfleet.detokenize.num_tokens", self.num_tokens)
                span.set_attribute("llmfleet.detokenize.stop_string_matched", self.stopped)
            span.end()

    async def _write(self, msg: tokenizer_pb2.DetokenizeRequest) -> None:
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise Unavailable(f"tokenizer: detokenize failed: {exc}") from None


def _consume(task: asyncio.Task[None]) -> None:
    """Mark a finished open's exception as seen (the next `feed` re-raises it)."""
    if not task.cancelled():
        task.exception()
