"""What every llmfleet gRPC service has: one shell around its servicers.

    svc = Service("worker", host, port, metrics_port=0)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, svc.server)
    await svc.start(["llmfleet.v1.Worker"])      # NOT_SERVING until ...
    await svc.set_serving()                       # ... the service is warm
    await svc.wait_for_termination()              # SIGTERM/SIGINT: NOT_SERVING, drain, stop

Standard `grpc.health.v1.Health`, server reflection, Prometheus `/metrics` on its own HTTP
port, OpenTelemetry tracing (`shared/wire/tracing.py`: set up from `OTEL_*` once per process; a
SERVER span for each RPC that arrives with a traceparent), graceful drain, message-size limits
and malformed-request handling (`shared/wire/limits.py`). Errors map to status codes in one
place (`status_for`); RESOURCE_EXHAUSTED carries a retry pushback (`abort_with`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Collection, Sequence

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from llmfleet.shared.core.errors import (
    CapacityError,
    LLMFleetError,
    ModelLoadError,
    ValidationError,
)
from llmfleet.shared.wire.limits import (
    DEFAULT_RETRY_AFTER_S,
    INTERNAL_MAX_MESSAGE_BYTES,
    DecodeGuard,
    pushback_metadata,
    server_options,
)
from llmfleet.shared.wire.tls import FleetTLS, add_port
from llmfleet.shared.wire.trace_grpc import ServerTracing
from llmfleet.shared.wire.tracing import setup_tracing

logger = logging.getLogger(__name__)


class Unavailable(LLMFleetError):
    """A peer this service needs is down or unreachable (maps to UNAVAILABLE)."""


class FailedPrecondition(LLMFleetError):
    """The operation does not apply to the current state, e.g. an expired lease."""


class NotFound(LLMFleetError):
    """The named object (request, lease) does not exist."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, FailedPrecondition | ModelLoadError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has unwound (a no-op for None)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status code of `exc` and its message (raises AbortError)."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
    trailing: tuple[tuple[str, str], ...] = ()
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # overload: tell when to retry
        trailing = pushback_metadata(getattr(exc, "retry_after_s", DEFAULT_RETRY_AFTER_S))
    await context.abort(code, str(exc), trailing_metadata=trailing)


class Service:
    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        *,
        metrics_port: int | None = 0,
        grace_s: float = 30.0,
        self_traced: Collection[str] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: FleetTLS | None = None,
        max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES,
    ) -> None:
        """`self_traced`: full method names ("/pkg.Service/Method") whose servicer makes its
        own SERVER span; `interceptors` run after tracing (e.g. api_key_auth.ApiKeyAuth);
        `max_message_bytes`: the largest message taken or sent (limits.py: a larger one is
        RESOURCE_EXHAUSTED); malformed requests are INVALID_ARGUMENT (limits.DecodeGuard)."""
        setup_tracing(name)
        self.name = name
        self.host = host
        self.requested_port = port
        self.metrics_port = metrics_port
        self.grace_s = grace_s
        self.tls = tls
        self.server = grpc.aio.server(
            interceptors=[ServerTracing(own_span=self_traced), *interceptors, DecodeGuard()],
            options=server_options(max_message_bytes),
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.service_names: list[str] = []
        self._stop = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, service_names: Sequence[str]) -> None:
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        # With `tls`: mutual TLS, callers need a certificate from the fleet CA.
        self.port = add_port(self.server, f"{self.host}:{self.requested_port}", self.tls)
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.requested_port}")
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.metrics_port is not None:
            httpd, _ = prometheus_client.start_http_server(self.metrics_port, addr=self.host)
            self.metrics_port = httpd.server_port
        logger.info("%s listening on %s (metrics :%s)", self.name, self.address, self.metrics_port)

    async def set_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def _set_all(self, status: int) -> None:
        for svc in ["", *self.service_names]:
            await self.health.set(svc, status)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_for_termination(self) -> None:
        """Block until a stop is requested, then drain: NOT_SERVING at once, new RPCs refused
        (UNAVAILABLE), open ones (streams included) finish within `grace_s`, the rest are
        cancelled; then return (the process exits 0)."""
        await self._stop.wait()
        logger.info("%s draining (grace %g s)", self.name, self.grace_s)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.grace_s)
        logger.info("%s stopped", self.name)
