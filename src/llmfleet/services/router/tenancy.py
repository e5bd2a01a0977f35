"""Who calls the public API, the prefix cache they may share and the requests they may abort.

With API keys configured every `Generation` call carries a key (api_key_auth.ApiKeyAuth has
turned away the rest). Its tenant's digest goes in front of the request's `cache_salt` before
anything hashes a block (routing here, the engine on the worker, the kvstore), so two tenants
never share prefix blocks, nor see each other's `cached_prompt_tokens`, while one tenant's
requests do. A running request belongs to its tenant: another tenant's Abort of its id finds
nothing. With auth off the client's salt is used as sent (callers sending none, e.g. every
HTTP client of the gateway, share one prefix cache) and anyone may abort any request.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc

from llmfleet.shared.core.api_keys import KeyRing, tenant_salt
from llmfleet.shared.wire.api_key_auth import caller_tenant
from llmfleet.v1 import generation_pb2


class Tenancy:
    """The tenants of one router; `_owner` (request id -> tenant) holds running requests."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys
        self._owner: dict[str, str] = {}

    @contextlib.asynccontextmanager
    async def admit(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """While the request runs: its `cache_salt` salted with its caller's tenant, and its
        id (assigned here when the client sent none) owned by that tenant."""
        if not self.keys.enabled:
            yield
            return
        tenant = caller_tenant(self.keys, context)
        if tenant is None:  # the interceptor stops these; never serve one unsalted
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")
            return
        request.cache_salt = tenant_salt(tenant, request.cache_salt)
        request.request_id = request.request_id or uuid.uuid4().hex
        # An id already running stays its owner's (the router rejects the duplicate).
        mine = request.request_id not in self._owner
        if mine:
            self._owner[request.request_id] = tenant
        try:
            yield
        finally:
            if mine:
                del self._owner[request.request_id]

    def may_abort(self, request_id: str, context: grpc.aio.ServicerContext) -> bool:
        """Whether the caller may abort `request_id`: its own request, or any with auth off."""
        if not self.keys.enabled:
            return True
        tenant = caller_tenant(self.keys, context)
        return tenant is not None and self._owner.get(request_id) == tenant
