"""API keys on a gRPC server: `authorization: Bearer SECRET` metadata for the protected services.

    svc = Service("router", host, port, interceptors=[ApiKeyAuth(ring, [GENERATION])])
    tenant = caller_tenant(ring, context)   # in a servicer: who called (None: auth off)

A call to a method of a protected service without a configured key ends UNAUTHENTICATED before
its servicer runs; other services (health, reflection, internal ones) pass untouched. With an
empty key ring the interceptor lets everything through.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc

from llmfleet.shared.core.api_keys import KeyRing, bearer_secret
from llmfleet.shared.wire.grpc_handlers import rebuild_handler

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
_UNAUTHENTICATED = "a valid API key is required: send metadata `authorization: Bearer <key>`"


def secret_of(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The bearer secret in call metadata, if any."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            return bearer_secret(value if isinstance(value, str) else value.decode())
    return None


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The metadata a client sends its key in (none without a key)."""
    return [(AUTHORIZATION, f"Bearer {api_key}")] if api_key else []


def caller_tenant(ring: KeyRing, context: grpc.aio.ServicerContext) -> str | None:
    """The tenant of the key the call carries; None with auth off (or no valid key)."""
    if not ring.enabled:
        return None
    return ring.tenant_of(secret_of(context.invocation_metadata()))


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
    yield  # an async generator, as a server-streaming handler is


class ApiKeyAuth(grpc.aio.ServerInterceptor):
    """Rejects calls to `services` (full names, e.g. "llmfleet.v1.Generation") without a key."""

    def __init__(self, ring: KeyRing, services: Collection[str]) -> None:
        self.ring = ring
        self.prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (
            handler is None
            or not self.ring.enabled
            or not details.method.startswith(self.prefixes)
            or self.ring.tenant_of(secret_of(details.invocation_metadata)) is not None
        ):
            return handler
        logger.debug("rejected %s: no valid API key", details.method)
        return rebuild_handler(handler, _deny_stream if handler.response_streaming else _deny_unary)
