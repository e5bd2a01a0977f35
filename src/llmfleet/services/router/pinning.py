"""Worker pins: a Generate call may name the worker it wants (a routing hint).

    pins = Pins()
    with pins.hold(request, context.invocation_metadata()):   # in the Generate servicer
        ...                                                   # placement.route: pins.get(id)

A caller (the gateway, relaying the endpoint picker's `x-llmfleet-worker` header) sends the
worker's registered address, or its id, as `x-llmfleet-worker` call metadata. While the call
runs its request id maps to that name; routing of the serving role (aggregated: the unified
worker, disaggregated: the decode worker) takes the named worker when it is live, not draining
and not excluded by a failure of this request, and routes as usual otherwise. Only the first
call of a request id holds a pin (a duplicate id is refused by the router anyway).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from llmfleet.shared.wire.worker_pin import WORKER_PIN_KEY
from llmfleet.v1 import generation_pb2


def pin_of(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The worker named in call metadata ("" when none)."""
    for key, value in metadata or ():
        if key == WORKER_PIN_KEY:
            return (value if isinstance(value, str) else value.decode()).strip()
    return ""


class Pins:
    """request id -> the worker its call named, while the call runs."""

    def __init__(self) -> None:
        self._pins: dict[str, str] = {}

    def get(self, request_id: str) -> str:
        return self._pins.get(request_id, "")

    def __len__(self) -> int:
        return len(self._pins)

    @contextlib.contextmanager
    def hold(
        self,
        request: generation_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, Any]] | None,
    ) -> Iterator[None]:
        """While the block runs: `request`'s pin from `metadata`, if any (a request without an
        id is given one here, as the router would)."""
        pin = pin_of(metadata)
        if not pin or (request.request_id and request.request_id in self._pins):
            yield
            return
        request.request_id = request.request_id or uuid.uuid4().hex
        self._pins[request.request_id] = pin
        try:
            yield
        finally:
            del self._pins[request.request_id]
