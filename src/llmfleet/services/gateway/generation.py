"""One Generate call per HTTP request, whatever API shapes the answer.

Chat and completions (streaming.ChunkShape), the Responses API (responses.py) and Anthropic's
Messages (anthropic.py) all answer through `run`: it starts the call with the caller's key and
routing hints, under the request's span (tracing.py), waits for the first delta (so that errors
up to then keep their HTTP status), then answers the whole result as JSON (`Shape.whole`) or
streams the events `Shape.events` yields. A client that leaves cancels the call
(streaming.DisconnectWatch). An error after the stream started is one event in the API's own
shape (`Shape.error_event`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from llmfleet.client.generation import ClientError
from llmfleet.client.messages import GenerateResult
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.auth import caller_key
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError, from_client_error, from_validation
from llmfleet.services.gateway.streaming import DisconnectWatch, Started
from llmfleet.services.gateway.tracing import end_request_span, ending_with, start_request_span
from llmfleet.services.gateway.upstream import ServedModel, Upstream
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.worker_pin import WORKER_PIN_KEY

logger = logging.getLogger(__name__)

# Names a request's conversation: its turns prefer the worker that served the last (over the
# body's `user`, which names it otherwise).
SESSION_HEADER = "x-session-id"


class Shape(Protocol):
    """How one API answers a call."""

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        """The non-streaming body."""
        ...

    def events(self, started: Started) -> AsyncIterator[str]:
        """The SSE text of a stream, from its first event to its last."""
        ...

    def error_event(self, error: APIError) -> str:
        """The SSE text telling of an error after the stream started."""
        ...


def worker_pin(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The worker an endpoint picker named for this request (`x-llmfleet-worker`), relayed to
    the router as call metadata: a routing hint (shared/wire/worker_pin.py)."""
    worker = headers.get(WORKER_PIN_KEY, "").strip()
    if not (worker and worker.isascii() and worker.isprintable()):  # (gRPC metadata is ASCII)
        return []
    return [(WORKER_PIN_KEY, worker)]


async def context_left(
    up: Upstream,
    served: ServedModel,
    messages: Sequence[Mapping[str, Any]],
    params: Mapping[str, str] | None = None,
    **render: Any,
) -> int:
    """The default max_tokens of a chat prompt: the context the rendered prompt leaves.
    `render`: `TokenSpeller.chat_prompt_len`'s keywords; `params` as `Call.params`."""
    try:
        num = await asyncio.to_thread(
            up.speller.chat_prompt_len,
            messages,
            max_num_tokens=served.info.max_model_len,
            **render,
        )
    except ValidationError as exc:
        raise from_validation(exc, params) from None
    return convert.default_max_tokens(num, served.info.max_model_len)


async def run(
    call: Call, served: ServedModel, up: Upstream, request: Request, shape: Shape
) -> Response:
    """Answer `call` in `shape`, under the request's span, which a stream ends when it ends."""
    if session := request.headers.get(SESSION_HEADER):  # the conversation, a routing hint
        call.kwargs["session_id"] = session
    span = start_request_span(request, call, served.name)
    try:
        with trace.use_span(span, end_on_exit=False):
            response = await _answer(call, up, request, shape)
    except APIError as exc:
        end_request_span(span, exc.status)
        raise
    except BaseException:
        end_request_span(span, 500)
        raise
    if isinstance(response, StreamingResponse):
        response.body_iterator = ending_with(response.body_iterator, span, response.status_code)
    else:
        end_request_span(span, response.status_code)
    return response


async def _answer(call: Call, up: Upstream, request: Request, shape: Shape) -> Response:
    try:
        stream = up.client.stream(
            request_id=call.request_id,
            timeout=up.config.request_timeout_s,
            api_key=caller_key(request.headers),  # the router checks it and salts by tenant
            metadata=worker_pin(request.headers),
            **call.kwargs,
        )
    except ValidationError as exc:
        raise from_validation(exc, call.params) from None
    watch = DisconnectWatch(request.receive, stream.cancel)
    deltas = aiter(stream)
    handed_over = False
    try:
        first = await anext(deltas, None)
        if call.stream:
            started = Started(call, stream, first, deltas)
            handed_over = True
            return StreamingResponse(
                _guarded(shape, started, watch),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        async for _ in deltas:
            pass
        return JSONResponse(shape.whole(stream.result))
    except ClientError as exc:
        if exc.code_name == "CANCELLED" and watch.disconnected:
            return Response(status_code=499)
        raise from_client_error(exc, call.params) from None
    except asyncio.CancelledError:
        if not watch.cancelled_us():
            raise
        logger.info("%s: the client disconnected; request cancelled", call.request_id)
        return Response(status_code=499)  # nobody reads it
    finally:
        if not handed_over:
            watch.close()
            stream.cancel()


async def _guarded(shape: Shape, started: Started, watch: DisconnectWatch) -> AsyncIterator[str]:
    """`shape.events`, owning `watch` and the call: an error becomes the shape's error event."""
    call = started.call
    try:
        async for text in shape.events(started):
            yield text
    except ClientError as exc:
        if exc.code_name == "CANCELLED" and watch.disconnected:
            return
        logger.warning("%s failed mid-stream: %s", call.request_id, exc)
        yield shape.error_event(from_client_error(exc, call.params))
    except APIError as exc:  # the shape's own (e.g. tool-call output that does not parse)
        yield shape.error_event(exc)
    except asyncio.CancelledError:
        if not watch.cancelled_us():
            raise
    finally:
        watch.close()
        started.stream.cancel()  # a no-op once the call has ended
