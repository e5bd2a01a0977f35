"""The router service: `llmfleet.v1.Generation` (public) and `llmfleet.v1.Registry` (workers).

    server = RouterServer(RouterConfig(port=0, tokenizer_address=...))
    await server.start()          # health NOT_SERVING until the tokenizer answers and a worker
    ...                           # of the serving role (unified / decode) is live
    await server.stop()

    await serve(config)           # the process entry point: runs until SIGTERM, then drains

The servicers are thin: protobuf in, `Router` (orchestrator.py) and `WorkerRegistry`
(registry.py) do the work, typed errors become status codes through `abort_with`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.services.router.embed import Embedder
from llmfleet.services.router.epp import EndpointPickerServer
from llmfleet.services.router.load_pb import load_from_pb, load_to_pb
from llmfleet.services.router.orchestrator import Router
from llmfleet.services.router.registry import ROLES
from llmfleet.services.router.request import WorkerFailed
from llmfleet.services.router.store_view import StoreView
from llmfleet.services.router.tenancy import Tenancy
from llmfleet.shared.core.api_keys import KeyRing
from llmfleet.shared.core.config import AuthConfig, RouterConfig
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.api_key_auth import ApiKeyAuth
from llmfleet.shared.wire.convert import (
    ROLE_FROM_PB,
    ROLE_TO_PB,
    model_info_from_pb,
    model_info_to_pb,
)
from llmfleet.shared.wire.limits import channel_options
from llmfleet.shared.wire.service import Service, abort_with
from llmfleet.shared.wire.tracing import context_from_metadata
from llmfleet.v1 import (
    embedding_pb2,
    generation_pb2,
    generation_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    tokenizer_pb2_grpc,
)

logger = logging.getLogger(__name__)

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
REGISTRY = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


def _version() -> str:
    try:
        return version("llmfleet")
    except PackageNotFoundError:
        return "0+unknown"


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def RegisterWorker(
        self, request: registry_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterWorkerResponse:
        try:
            if not request.worker_id:
                raise ValidationError("worker_id", "must not be empty")
            role = ROLE_FROM_PB.get(request.role)
            if role not in ROLES:
                raise ValidationError("role", "must be unified, prefill or decode")
            if not request.address:
                raise ValidationError("address", "must not be empty")
            model = model_info_from_pb(request.model)
            reg = self.router.registry.register(
                request.worker_id,
                role,
                request.address,
                request.kv_events_endpoint,
                model,
                load_from_pb(request.load),
            )
        except ValidationError as exc:
            await abort_with(context, exc)
            raise
        resubscribe = reg.is_new or reg.events_changed or reg.address_changed
        self.router.on_registered(
            request.worker_id,
            reg.address_changed,
            request.kv_events_endpoint if resubscribe else None,
        )
        logger.info("worker %s (%s) registered at %s", request.worker_id, role, request.address)
        return registry_pb2.RegisterWorkerResponse(
            heartbeat_interval_ms=self.router.config.heartbeat_interval_ms
        )

    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        load = load_from_pb(request.load) if request.HasField("load") else None
        return registry_pb2.HeartbeatResponse(
            known=self.router.registry.heartbeat(request.worker_id, load)
        )

    async def DeregisterWorker(
        self, request: registry_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DeregisterWorkerResponse:
        wid = request.worker_id
        if not request.draining:
            self.router.worker_gone(wid, request.reason or "deregistered")
            return registry_pb2.DeregisterWorkerResponse()
        info = self.router.registry.get(wid)
        if info is None or not self.router.registry.set_draining(wid):  # no new requests to it
            return registry_pb2.DeregisterWorkerResponse()
        moved: list[str] = []  # its queued requests move only where new ones can go
        replaced = self.router.registry.taking(info.role)
        if replaced:
            queued = set(request.request_ids)
            for run in self.router.runs.values():
                legs = run.legs_on(wid, queued)
                if legs:
                    run.events.put_nowait(WorkerFailed(wid, "draining"))
                    moved += legs
        logger.info("worker %s draining; %d queued requests move elsewhere", wid, len(moved))
        return registry_pb2.DeregisterWorkerResponse(moved_request_ids=moved, replaced=replaced)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router, keys: KeyRing | None = None) -> None:
        self.router = router
        self.tenancy = Tenancy(keys or KeyRing())
        self.embedder = Embedder(router)  # Embed (embed.py)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        parent = context_from_metadata(context.invocation_metadata())
        pins = self.router.placement.pins  # a worker the call names (pinning.py)
        async with self.tenancy.admit(request, context):  # the tenant's own prefix cache
            with pins.hold(request, context.invocation_metadata()):
                try:
                    async for resp in self.router.generate(request, parent):
                        yield resp
                except LLMFleetError as exc:
                    await abort_with(context, exc)

    async def Embed(
        self, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        try:
            return await self.embedder.embed(
                request, context_from_metadata(context.invocation_metadata())
            )
        except LLMFleetError as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort_with raises

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        mine = self.tenancy.may_abort(request.request_id, context)  # another tenant's: unseen
        return generation_pb2.AbortResponse(found=mine and self.router.abort(request.request_id))

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetModelInfoResponse:
        model = self.router.model()
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no live worker serves a model")
        return generation_pb2.GetModelInfoResponse(model=model_info_to_pb(model))

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        cfg = self.router.config
        return generation_pb2.GetServerInfoResponse(
            version=_version(),
            mode=cfg.mode,
            routing_policy=cfg.routing_policy,
            workers=[
                generation_pb2.WorkerStatus(
                    worker_id=w.worker_id,
                    role=ROLE_TO_PB[w.role],
                    address=w.address,
                    load=load_to_pb(w.load),
                    num_indexed_blocks=self.router.kv.index.num_blocks(w.worker_id),
                )
                for w in self.router.registry.live()
            ],
        )


class RouterServer:
    """The running service: gRPC servicers, the router core, health and liveness loops."""

    def __init__(
        self, config: RouterConfig, *, expose_metrics: bool = True, auth: AuthConfig | None = None
    ) -> None:
        """`auth`: API keys of the public `Generation` API (None or empty: open)."""
        self.config = config
        keys = (auth or AuthConfig()).keyring
        self.service = Service(
            "router",
            config.host,
            config.port,
            metrics_port=config.metrics_port if expose_metrics else None,
            grace_s=config.grace_s,
            self_traced=[f"/{GENERATION}/Generate"],  # its span is the router's llm_request
            interceptors=[ApiKeyAuth(keys, [GENERATION])],  # Registry: internal, no keys
            max_message_bytes=config.max_message_bytes,  # larger: RESOURCE_EXHAUSTED
        )
        # With a TLS dir: mutual TLS to tokenizer, workers and kvstore, CURVE on every socket.
        self.tls = tls.load(config.tls_dir)
        self._ctx = tls.zmq_context(self.tls)
        self._tok_channel = tls.aio_channel(config.tokenizer_address, self.tls, channel_options())
        tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._tok_channel)
        self.router = Router(config, self._ctx, tokenizer, self.tls)
        self.store_view: StoreView | None = None
        if config.kvstore_address and config.kvstore_events_endpoint:
            self.store_view = StoreView(
                self._ctx, config.kvstore_address, config.kvstore_events_endpoint, self.tls
            )
            self.router.placement.store = self.store_view
        self._health_stub = health_pb2_grpc.HealthStub(self._tok_channel)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.router, keys), self.service.server
        )
        # The workers' Registry: on its own internal port (mutual TLS with a TLS dir), else on
        # the public one.
        self.internal: Service | None = None
        if config.internal_port is not None:
            self.internal = Service(
                "router",
                config.internal_host,
                config.internal_port,
                metrics_port=None,
                grace_s=config.grace_s,
                tls=self.tls,
            )
        registry_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(self.router), (self.internal or self.service).server
        )
        self.epp = (
            None if config.epp_port is None else EndpointPickerServer(config, self.router, keys)
        )
        self._loops: list[asyncio.Task[None]] = []
        self.serving = False
        self._tokenizer_seen_at = -float("inf")  # its last SERVING answer (monotonic s)

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def registry_address(self) -> str:
        """Where workers register (`--router` of a worker)."""
        return (self.internal or self.service).address

    async def start(self) -> None:
        self.router.start()
        if self.store_view is not None:
            self.store_view.start()
        if self.internal is not None:
            await self.internal.start([REGISTRY])
            await self.internal.set_serving()  # workers register before the router serves
        await self.service.start([GENERATION] if self.internal else [GENERATION, REGISTRY])
        if self.epp is not None:  # the Envoy ext_proc endpoint picker (epp.py)
            await self.epp.start()
        self._loops = [asyncio.create_task(self._liveness_loop())]
        logger.info(
            "router on %s (%s, %s), registry on %s, replies on %s",
            self.address,
            self.config.mode,
            self.config.routing_policy,
            self.registry_address,
            self.router.replies.endpoint,
        )

    def begin_drain(self) -> None:
        """Stop taking requests (health NOT_SERVING); running ones finish within the grace."""
        self.router.draining = True
        for task in self._loops:
            task.cancel()
        self.service.request_stop()

    async def wait_drained(self) -> None:
        await self.service.wait_for_termination()
        await self._close()

    async def drain(self) -> None:
        self.begin_drain()
        await self.wait_drained()

    async def stop(self, grace_s: float = 0.0) -> None:
        self.router.draining = True
        for task in self._loops:
            task.cancel()
        await self.service.server.stop(grace_s)
        await self._close()

    async def _close(self) -> None:
        if self.internal is not None:  # heartbeats went on while the public port drained
            await self.internal.server.stop(0)
        if self.epp is not None:
            await self.epp.stop()
        await self.router.close()
        if self.store_view is not None:
            await self.store_view.close()
        await self._tok_channel.close()
        self._ctx.term()

    async def _tokenizer_ready(self) -> bool:
        """The tokenizer answered SERVING lately. A check that merely timed out (a starved
        CPU) is no news: only a NOT_SERVING answer, or silence for a heartbeat timeout, is."""
        timeout_s = self.config.heartbeat_timeout_ms / 1000
        try:
            resp = await self._health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            # A tokenizer without the health service still answered.
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                return True
            return time.monotonic() - self._tokenizer_seen_at < timeout_s
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        self._tokenizer_seen_at = time.monotonic()
        return True

    async def _liveness_loop(self) -> None:
        """Drop silent workers; SERVING exactly while the tokenizer and a usable worker are up."""
        period = min(self.config.heartbeat_interval_ms, self.config.heartbeat_timeout_ms / 4)
        while True:
            self.router.sweep()
            serving = self.router.usable() and await self._tokenizer_ready()
            if serving != self.serving:
                self.serving = serving
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ("", GENERATION, REGISTRY):
                    await self.service.health.set(name, status)
                if self.epp is not None:
                    await self.epp.set_serving(serving)
                logger.info("router %s", "SERVING" if serving else "NOT_SERVING")
            await asyncio.sleep(period / 1000.0)


async def serve(
    config: RouterConfig,
    auth: AuthConfig | None = None,
    *,
    on_started: Callable[[RouterServer], None] | None = None,
) -> None:
    """Run the router until SIGTERM/SIGINT (or `server.begin_drain()`), then drain."""
    server = RouterServer(config, auth=auth)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, server.begin_drain)
    if on_started is not None:
        on_started(server)
    await server.wait_drained()
