"""The OpenAI-compatible HTTP API over the router's gRPC `Generation` API (FastAPI).

    app = create_app(GatewayConfig(router_address="127.0.0.1:50051"))
    uvicorn.run(app, port=8000)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}], GET /health
(200 once the router reports a model, else 503), GET /metrics (Prometheus); the Responses API
(responses.py), Anthropic's Messages (anthropic.py) and /v1/embeddings (embeddings.py) install
their own. Every error, including malformed bodies and unknown routes, is answered in OpenAI's
error shape (errors.py; Anthropic's under /v1/messages); a body over `max_request_bytes` is a
413 before it is read (body_limit.py). A request names the served model or gets a 404; each
becomes exactly one Generate call (generation.py) whose gRPC request id is the response's `id`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmfleet.services.gateway import anthropic, convert, embeddings, responses
from llmfleet.services.gateway.auth import ApiKeyMiddleware
from llmfleet.services.gateway.body_limit import BodyLimitMiddleware
from llmfleet.services.gateway.errors import APIError, invalid
from llmfleet.services.gateway.fleet_metrics import FleetGauges, router_load
from llmfleet.services.gateway.generation import context_left, run
from llmfleet.services.gateway.metrics import MetricsMiddleware
from llmfleet.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.services.gateway.streaming import ChunkShape
from llmfleet.services.gateway.upstream import ServedModel, Upstream
from llmfleet.shared.core.config import AuthConfig, GatewayConfig

logger = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
ROUTES += responses.ROUTES + anthropic.ROUTES
ROUTES += embeddings.ROUTES
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
        tok, images = tokenizer, None
        if tok is None:
            from llmfleet.text.image_processing import load_image_processor
            from llmfleet.text.loading import load_tokenizer

            tok = await asyncio.to_thread(load_tokenizer, config.model)
            # A vision-language model's: it counts images' tokens for the default max_tokens.
            images = await asyncio.to_thread(load_image_processor, config.model, tok)
        app.state.upstream = Upstream(config, tok, api_key=keys.any_secret(), images=images)
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
    responses.install(app, config)  # /v1/responses
    anthropic.install(app)  # /v1/messages
    embeddings.install(app)  # /v1/embeddings

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        call = convert.chat_call(body)
        if call.kwargs["max_tokens"] is None:
            call.kwargs["max_tokens"] = await context_left(
                up,
                served,
                call.kwargs["messages"],
                call.params,
                add_generation_prompt=call.kwargs["add_generation_prompt"],
                tools=call.kwargs.get("tools", ()),
            )
        return await run(call, served, up, request, ChunkShape(call, served.name, up.speller))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        call = convert.completion_call(body)
        return await run(call, served, up, request, ChunkShape(call, served.name, up.speller))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        served = await request.app.state.upstream.model(refresh=True)
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        return _model_card(await request.app.state.upstream.require(model))

    # The fleet's load under GIE's names, with the gateway's own metrics (fleet_metrics.py).
    gauges = app.state.fleet_gauges = FleetGauges(lambda: router_load(app.state.upstream))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await gauges.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

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
