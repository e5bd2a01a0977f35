"""The OpenAI-compatible HTTP API over the router's gRPC `Generation` API (FastAPI).

    app = create_app(GatewayConfig(router_address="127.0.0.1:50051"))
    uvicorn.run(app, port=8000)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}], GET /health
(200 once the router reports a model, else 503), GET /metrics (Prometheus). Every error,
including malformed bodies and unknown routes, is answered in OpenAI's error shape
(errors.py); a body over `max_request_bytes` is a 413 before it is read (body_limit.py). A
request names the served model or gets a 404; each becomes exactly one Generate call whose gRPC
request id is the response's `id`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmfleet.client.generation import ClientError
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.auth import ApiKeyMiddleware, caller_key
from llmfleet.services.gateway.body_limit import BodyLimitMiddleware
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError, from_client_error, from_validation, invalid
from llmfleet.services.gateway.metrics import MetricsMiddleware
from llmfleet.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.services.gateway.streaming import ChunkBuilder, DisconnectWatch, sse
from llmfleet.services.gateway.tracing import end_request_span, ending_with, start_request_span
from llmfleet.services.gateway.upstream import ServedModel, Upstream
from llmfleet.shared.core.config import AuthConfig, GatewayConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.worker_pin import WORKER_PIN_KEY

logger = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
# FastAPI >= 0.16x traces every request itself (health checks included) once a tracer provider
# is set; the gateway makes its own span, for generation requests only (tracing.py).
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def create_app(
    config: GatewayConfig, *, tokenizer: Any = None, auth: AuthConfig | None = None
) -> FastAPI:
    """The ASGI app; `tokenizer` (the served model's) is loaded from `config.model` if None;
    `auth`: the API keys callers must send (None or empty: open; auth.py)."""
    keys = (auth or AuthConfig()).keyring

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok = tokenizer
        if tok is None:
            from llmfleet.text.loading import load_tokenizer

            tok = await asyncio.to_thread(load_tokenizer, config.model)
        app.state.upstream = Upstream(config, tok, api_key=keys.any_secret())
        try:
            yield
        finally:
            await app.state.upstream.close()

    app = FastAPI(
        title="llmfleet", lifespan=lifespan, docs_url=None, redoc_url=None, **_NO_NATIVE_TELEMETRY
    )
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(MetricsMiddleware, endpoints=ROUTES)
    _install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        call = convert.chat_call(body)
        if call.kwargs["max_tokens"] is None:
            call.kwargs["max_tokens"] = await _context_left(up, served, call)
        return await _generate(call, served, up, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        return await _generate(convert.completion_call(body), served, up, request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        served = await request.app.state.upstream.model(refresh=True)
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        return _model_card(await request.app.state.upstream.require(model))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            served = await request.app.state.upstream.model(refresh=True)
        except APIError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message}, 503)
        return JSONResponse({"status": "ok", "model": served.name})

    return app


def _model_card(served: ServedModel) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "llmfleet",
        "root": served.info.model_id,
        "max_model_len": served.info.max_model_len,
    }


async def _context_left(up: Upstream, served: ServedModel, call: Call) -> int:
    """Chat's default max_tokens: the context the rendered prompt leaves."""
    try:
        num = await asyncio.to_thread(
            up.speller.chat_prompt_len,
            call.kwargs["messages"],
            add_generation_prompt=call.kwargs["add_generation_prompt"],
            max_num_tokens=served.info.max_model_len,
        )
    except ValidationError as exc:
        raise from_validation(exc) from None
    return convert.default_max_tokens(num, served.info.max_model_len)


# Names a request's conversation: its turns prefer the worker that served the last (over the
# body's `user`, which names it otherwise).
SESSION_HEADER = "x-session-id"


async def _generate(call: Call, served: ServedModel, up: Upstream, request: Request) -> Response:
    """`_answer` under the request's span (tracing.py), which a stream ends when it ends."""
    if session := request.headers.get(SESSION_HEADER):  # the conversation, a routing hint
        call.kwargs["session_id"] = session
    span = start_request_span(request, call, served.name)
    try:
        with trace.use_span(span, end_on_exit=False):
            response = await _answer(call, served, up, request)
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


def worker_pin(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The worker an endpoint picker named for this request (`x-llmfleet-worker`), relayed to
    the router as call metadata: a routing hint (shared/wire/worker_pin.py)."""
    worker = headers.get(WORKER_PIN_KEY, "").strip()
    if not (worker and worker.isascii() and worker.isprintable()):  # (gRPC metadata is ASCII)
        return []
    return [(WORKER_PIN_KEY, worker)]


async def _answer(call: Call, served: ServedModel, up: Upstream, request: Request) -> Response:
    """Run one Generate call: the whole answer, or an SSE stream once the first delta is in
    (so that errors before it still get their HTTP status)."""
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
            builder = ChunkBuilder(call, served.name, up.speller)
            body = sse(builder, stream, deltas, first, watch)
            handed_over = True
            return StreamingResponse(
                body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        async for _ in deltas:
            pass
        return JSONResponse(convert.response(call, served.name, stream.result, up.speller))
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


# ---- errors -------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return body_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(404, f"no route {request.url.path}", code="not_found").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error serving %s", request.url.path, exc_info=exc)
        return APIError(500, "internal server error", type="server_error").response()


def body_error(errors: Sequence[Any]) -> APIError:
    """A 400 naming the first invalid field of a request body (pydantic's error list)."""
    if not errors:
        return invalid(None, "invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return invalid(None, f"the body is not valid JSON: {err.get('msg', '')}")
    param = loc_to_param(err.get("loc", ()))
    message = err.get("msg", "invalid value")
    return invalid(param, f"{param}: {message}" if param else message)


def loc_to_param(loc: Sequence[str | int]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; union tags ("str") are dropped."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not p.isidentifier() or p in _TYPE_TAGS or p[:1].isupper():
            break  # the member of a union pydantic tried: not part of the client's path
        else:
            out += f".{p}" if out else p
    return out or None
