"""A worker whose forward pass failed: it hands its requests back and leaves, exiting non-zero.

    loop.py: a step raised -> it steps no more and sends nothing; on the event loop:
    hand_back(reason, ...)  -> NOT_SERVING; prefills waiting here fail (UNAVAILABLE, naming the
                               failure: the router tries another prefill worker); deregister with
                               the reason (the router re-submits this worker's requests elsewhere,
                               or fails them with UNAVAILABLE naming it when none can take them)
    then the worker stops at once and its process exits 1 (`ForwardPassFailed`), so that a
    supervisor (`llmfleet up`, Kubernetes) restarts it.

No request ends "successfully" with tokens missing: the failed step's requests get no final
output from this worker (an abort would read as a finished stream).
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2

from llmfleet.services.worker.prefill_side import PrefillSide
from llmfleet.services.worker.registration import Registrar
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.wire.service import Service, Unavailable

logger = logging.getLogger(__name__)


class ForwardPassFailed(LLMFleetError):
    """The worker's forward pass failed; it served its last request (exit status 1)."""


def describe(error: BaseException) -> str:
    """The failure as the router and its clients read it (the router adds the worker's id)."""
    return f"forward pass failed: {type(error).__name__}: {error}"


async def hand_back(
    reason: str,
    service: Service,
    prefill: PrefillSide | None,
    registrar: Registrar | None,
) -> None:
    """Take the worker out of the fleet after its forward pass failed (see the module)."""
    logger.error("%s; handing its requests back and leaving the fleet", reason)
    for name in ["", *service.service_names]:
        await service.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if prefill is not None:
        prefill.fail_all(Unavailable(reason))
    if registrar is not None:
        await registrar.deregister(reason)
