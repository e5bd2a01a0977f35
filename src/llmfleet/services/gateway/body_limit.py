"""The request-body limit: a body over `max_request_bytes` is answered 413, never read whole.

A plain ASGI middleware. With a Content-Length the answer comes before any of the body is read.
A chunked body (no Content-Length) is read up to the limit and, when it stays within it, handed
to the app as one message followed by the connection's own messages (the disconnect watch reads
those); once it passes the limit reading stops and the answer is 413. At most `limit` bytes of a
body are ever held.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmfleet.services.gateway.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than the limit of {limit} bytes (max_request_bytes)",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.limit:
                await _answer(too_large(self.limit), scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its length
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await _answer(too_large(self.limit), scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(bytes(body), receive), send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server has already refused a malformed one
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error.response()
    response.headers["connection"] = "close"  # the unread body cannot be skipped cheaply
    await response(scope, receive, send)
