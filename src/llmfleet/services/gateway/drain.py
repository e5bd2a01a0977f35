"""The gateway's graceful drain: on SIGTERM/SIGINT, 503 to new requests, open ones finish.

    server = DrainingServer(uvicorn.Config(DrainGate(app), ...), grace_s=30.0)
    await server.serve()        # SIGTERM: draining; returns once drained; the process exits 0

Draining: every new HTTP request (`/health` included, so a load balancer or a Kubernetes
readiness probe sees it at once) is answered 503 with an OpenAI-style error body and
`Connection: close`; requests already open (streams included) go on until they end or `grace_s`
has passed; then uvicorn shuts down (what is still open is cancelled). A second signal ends the
drain at once. The signal is not re-raised afterwards (uvicorn's default), so a drained gateway
exits with status 0.
"""

from __future__ import annotations

import json
import logging
import time
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

_BODY = json.dumps(
    {"error": {"message": "the gateway is draining", "type": "unavailable", "code": 503}}
).encode()


class DrainGate:
    """ASGI wrapper: passes everything through until `draining`, then answers HTTP with 503."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.draining = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.draining and scope["type"] == "http":
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", b"1"),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _BODY})
            return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first signal starts a drain through its `DrainGate` app."""

    def __init__(self, config: uvicorn.Config, *, grace_s: float) -> None:
        super().__init__(config)
        if not isinstance(config.app, DrainGate):
            raise TypeError("DrainingServer serves a DrainGate app")
        self.gate: DrainGate = config.app
        self.grace_s = grace_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gate.draining:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = True
            return
        self.gate.draining = True
        self._drain_deadline = time.monotonic() + self.grace_s
        logger.info("gateway draining (grace %.0f s)", self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            if not self.server_state.tasks:
                logger.info("gateway drained")
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                logger.warning(
                    "gateway grace over: closing %d open requests", len(self.server_state.tasks)
                )
                self.should_exit = self.force_exit = True  # no second grace in the shutdown
        return await super().on_tick(counter)
