"""API keys at the gateway's HTTP door.

With keys configured (AuthConfig), every route but `/health` and `/metrics` needs
`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's); anything
else is a 401 in OpenAI's error shape (Anthropic's under /v1/messages), before the body is
read. The caller's key is forwarded to the router as gRPC `authorization` metadata with its
Generate call (`caller_key`), so the router checks it again and derives the tenant (its
prefix-cache salt) itself; the gateway's own calls (GetModelInfo for /health and /v1/models)
carry a configured key of the gateway's.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from llmfleet.services.gateway.anthropic_convert import error_response
from llmfleet.services.gateway.errors import APIError
from llmfleet.shared.core.api_keys import KeyRing, bearer_secret

OPEN_PATHS = frozenset({"/health", "/metrics"})
ANTHROPIC_PATHS = "/v1/messages"  # answered in Anthropic's error shape (anthropic_convert.py)


def caller_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key`."""
    return bearer_secret(headers.get("authorization")) or headers.get("x-api-key") or None


def unauthorized(has_key: bool) -> APIError:
    message = (
        "Incorrect API key provided."
        if has_key
        else "You didn't provide an API key: send `Authorization: Bearer <key>`."
    )
    return APIError(401, message, code="invalid_api_key")


class ApiKeyMiddleware:
    """Pure ASGI: answers 401 to HTTP requests off `OPEN_PATHS` without a configured key."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        key = caller_key(headers)
        if self.keys.tenant_of(key) is not None:
            await self.app(scope, receive, send)
            return
        error = unauthorized(key is not None)
        anthropic = scope["path"].startswith(ANTHROPIC_PATHS)
        response = error_response(error) if anthropic else error.response()
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)
