"""Run the gateway: uvicorn serving `create_app(config)` until SIGTERM/SIGINT.

On a signal the gateway drains (drain.py): new requests get 503, open requests (streams
included) finish for `grace_s`, then the rest are closed (their Generate calls are cancelled)
with the gRPC channel, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import prometheus_client
import uvicorn

from llmfleet.services.gateway.app import create_app
from llmfleet.services.gateway.drain import DrainGate, DrainingServer
from llmfleet.shared.core.config import AuthConfig, GatewayConfig
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.wire.tracing import setup_tracing

logger = logging.getLogger(__name__)


def build_server(
    config: GatewayConfig, *, tokenizer: Any = None, auth: AuthConfig | None = None
) -> uvicorn.Server:
    app = DrainGate(create_app(config, tokenizer=tokenizer, auth=auth))
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,  # the process's logging setup
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=config.grace_s,
        ),
        grace_s=config.grace_s,
    )


def bound_address(server: uvicorn.Server) -> str:
    """HOST:PORT the started server listens on (the real port when configured with 0)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"{host}:{port}"


async def serve(
    config: GatewayConfig, auth: AuthConfig | None = None, *, tokenizer: Any = None
) -> None:
    """Serve until a signal; raises LLMFleetError when the app could not start (e.g. the
    tokenizer failed to load; uvicorn has logged why)."""
    setup_tracing("gateway")  # OTEL_* variables; a bad value stops the start, naming it
    server = build_server(config, tokenizer=tokenizer, auth=auth)
    if config.metrics_port is not None:  # the same body as the HTTP port's /metrics
        gauges = server.config.app.app.state.fleet_gauges  # DrainGate(FastAPI app)
        gauges.bind(asyncio.get_running_loop())
        httpd, _ = prometheus_client.start_http_server(
            config.metrics_port, addr=config.host, registry=gauges
        )
        logger.info("gateway metrics on :%d", httpd.server_port)
    await server.serve()
    if not server.started:
        raise LLMFleetError("the gateway did not start")
