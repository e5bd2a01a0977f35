"""Registration with the router's Registry, and heartbeats, while the worker serves.

    RegisterWorker -> heartbeat every `heartbeat_interval_ms` (the router's answer)
    known=false (the router restarted)   -> register again
    router unreachable                   -> retry with exponential backoff (capped), forever
    drain(queued)                        -> DeregisterWorker(draining): no new requests, the
                                            queued ones move; heartbeats go on (no re-register)
    close()                              -> DeregisterWorker: leave the pool

State changes (registered, lost, re-registered) are logged once each, not per attempt.
`registered` is set after the first successful registration (the worker turns SERVING then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from llmfleet.shared.wire.limits import channel_options
from llmfleet.shared.wire.service import cancel_and_wait
from llmfleet.shared.wire.tls import FleetTLS, aio_channel
from llmfleet.v1 import common_pb2, registry_pb2, registry_pb2_grpc

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0


class Registrar:
    def __init__(
        self,
        router_address: str,
        make_request: Callable[[], registry_pb2.RegisterWorkerRequest],
        load: Callable[[], common_pb2.LoadReport],
        *,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        tls: FleetTLS | None = None,
    ) -> None:
        self.router_address = router_address
        self._make_request = make_request
        self._load = load
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self.registered = asyncio.Event()
        self.num_registrations = 0
        self._channel = aio_channel(router_address, tls, channel_options())
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self._worker_id = ""
        self._draining = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="registrar")

    async def _register(self) -> float:
        req = self._make_request()
        self._worker_id = req.worker_id
        resp = await self._stub.RegisterWorker(req, timeout=RPC_TIMEOUT_S)
        self.num_registrations += 1
        self.registered.set()
        return max(resp.heartbeat_interval_ms, 10) / 1000

    async def _run(self) -> None:
        backoff = self._min_backoff
        interval: float | None = None  # None: not registered
        reachable = True
        while True:
            try:
                if interval is None:
                    interval = await self._register()
                    logger.info(
                        "registered with %s (heartbeat every %.0f ms)",
                        self.router_address,
                        interval * 1000,
                    )
                else:
                    await asyncio.sleep(interval)
                    resp = await self._stub.Heartbeat(
                        registry_pb2.HeartbeatRequest(worker_id=self._worker_id, load=self._load()),
                        timeout=RPC_TIMEOUT_S,
                    )
                    if not resp.known and self._draining:
                        return  # removed while draining: it must not take traffic again
                    if not resp.known:
                        logger.info("router %s forgot us: registering again", self.router_address)
                        interval = None
                        continue
                if not reachable:
                    logger.info("router %s reachable again", self.router_address)
                    reachable = True
                backoff = self._min_backoff
            except grpc.aio.AioRpcError as e:
                if reachable:
                    logger.warning(
                        "router %s unreachable (%s); retrying with backoff",
                        self.router_address,
                        e.code().name,
                    )
                    reachable = False
                interval = None  # after an outage, register again: it may have restarted
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)

    async def drain(self, queued: list[str]) -> tuple[list[str], bool]:
        """Tell the router this worker drains: unless it is the last of its role, the router
        routes nothing new here and re-submits the `queued` (not started) requests elsewhere.
        Returns those it took (the worker aborts them and finishes the rest itself) and
        whether other workers take new requests (else the router may still send some)."""
        self._draining = True
        if not self.registered.is_set():
            return [], True
        req = registry_pb2.DeregisterWorkerRequest(
            worker_id=self._worker_id, draining=True, request_ids=queued
        )
        try:
            resp = await self._stub.DeregisterWorker(req, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            logger.warning("telling %s about the drain failed: %s", self.router_address, e.code())
            return [], True
        return list(resp.moved_request_ids), resp.replaced

    async def deregister(self, reason: str = "") -> None:
        """Stop heartbeating and leave the pool (best effort); the router re-submits the
        requests still here elsewhere, and names `reason` if they can run nowhere."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self.registered.is_set():
            try:
                await self._stub.DeregisterWorker(
                    registry_pb2.DeregisterWorkerRequest(worker_id=self._worker_id, reason=reason),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as e:
                logger.warning("deregistering from %s failed: %s", self.router_address, e.code())

    async def close(self) -> None:
        await self.deregister()
        await self._channel.close()
