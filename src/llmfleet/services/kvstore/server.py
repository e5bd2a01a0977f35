"""The kvstore service: `llmfleet.v1.KVStore` (gRPC control), the ZMQ data plane (ROUTER) and
KV events (PUB), around one BlockStore.

    server = await serve(KVStoreConfig(port=0))   # SERVING once the disk tier is indexed
    server.address, server.data_endpoint, server.events_endpoint, server.metrics_port
    await server.stop()                           # or: request_stop() + wait_for_termination()

Shutdown order: health NOT_SERVING, gRPC drains (grace), then the data plane stops between two
messages (the one being served is answered), the store's thread finishes its call, sockets close.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import zmq
import zmq.asyncio

from llmfleet.services.kvstore.dataplane import DataPlane
from llmfleet.services.kvstore.runner import StoreRunner
from llmfleet.services.kvstore.store import HASH_BYTES, BlockStore
from llmfleet.shared.core.config import KVStoreConfig
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.kv_events import KVEventPublisher
from llmfleet.shared.wire.service import Service, Unavailable, abort_with
from llmfleet.shared.wire.transport import Frame, bind, recv_loop
from llmfleet.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
PUBLISHER_ID = "kvstore"


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Registered before the server starts; answers UNAVAILABLE until `runner` is set."""

    def __init__(self) -> None:
        self.runner: StoreRunner | None = None

    def _ready(self) -> StoreRunner:
        if self.runner is None:
            raise Unavailable("kvstore is starting")
        return self.runner

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        try:
            if not request.layout:
                raise ValidationError("layout", "must be set")
            for i, h in enumerate(request.block_hashes):
                if len(h) != HASH_BYTES:
                    raise ValidationError(
                        f"block_hashes[{i}]", f"must be {HASH_BYTES} bytes, got {len(h)}"
                    )
            n = await self._ready().lookup(request.layout, list(request.block_hashes))
        except LLMFleetError as e:
            await abort_with(context, e)
            raise  # unreachable: abort_with raises
        return kvstore_pb2.LookupResponse(num_matched=n)

    async def GetStoreStats(
        self, request: kvstore_pb2.GetStoreStatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetStoreStatsResponse:
        try:
            stats = await self._ready().stats()
        except LLMFleetError as e:
            await abort_with(context, e)
            raise  # unreachable: abort_with raises
        return kvstore_pb2.GetStoreStatsResponse(
            tiers=[
                kvstore_pb2.TierStats(
                    tier=t.tier,
                    num_blocks=t.num_blocks,
                    bytes=t.bytes,
                    capacity_bytes=t.capacity_bytes,
                    hits=t.hits,
                    evictions=t.evictions,
                )
                for t in stats.tiers
            ],
            misses=stats.misses,
            puts=stats.puts,
        )

    async def GetKVSnapshot(
        self, request: worker_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetKVSnapshotResponse:
        try:
            publisher = self._ready().publisher
        except LLMFleetError as e:
            await abort_with(context, e)
            raise  # unreachable: abort_with raises
        snap = publisher.snapshot()
        return worker_pb2.GetKVSnapshotResponse(
            publisher_id=snap.publisher_id,
            seq=snap.seq,
            block_hashes=snap.block_hashes,
            epoch=snap.epoch,
        )


class KVStoreServer:
    """A running kvstore (build it with `serve`)."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.tls = tls.load(config.tls_dir)
        self.service = Service(
            "kvstore", config.host, config.port, metrics_port=config.metrics_port, tls=self.tls
        )
        self.data_endpoint = ""
        self.events_endpoint = ""
        self.servicer = KVStoreServicer()
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(self.servicer, self.service.server)
        self.runner: StoreRunner | None = None
        self.data_plane: DataPlane | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._handling = asyncio.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def metrics_port(self) -> int | None:
        return self.service.metrics_port

    async def start(self) -> None:
        cfg = self.config
        await self.service.start([SERVICE_NAME])  # NOT_SERVING until the store is ready
        loop = asyncio.get_running_loop()
        # Indexing a large disk tier takes a while: off the event loop, so health answers.
        store = await loop.run_in_executor(
            None, lambda: BlockStore(cfg.ram_bytes, cfg.disk_dir, cfg.disk_bytes)
        )
        self._ctx = tls.zmq_context(self.tls)  # with tls: the data and event ports are CURVE
        publisher = KVEventPublisher(self._ctx, cfg.host, PUBLISHER_ID, cfg.events_port)
        self.events_endpoint = publisher.endpoint
        self.runner = StoreRunner(store, publisher)
        self._router, self.data_endpoint = bind(self._ctx, zmq.ROUTER, cfg.host, cfg.data_port)
        self.data_plane = DataPlane(self._router, self.runner)
        await self.runner.start()
        self.servicer.runner = self.runner
        self._loop_task = asyncio.create_task(
            recv_loop(self._router, self._handle, name="kvstore data plane")
        )
        await self.service.set_serving()
        logger.info(
            "kvstore ready: grpc=%s data=%s events=%s metrics=%s ram_bytes=%d disk=%s",
            self.address, self.data_endpoint, self.events_endpoint, self.metrics_port,
            cfg.ram_bytes, cfg.disk_dir or "-",
        )  # fmt: skip

    async def _handle(self, frames: list[Frame]) -> None:
        async with self._handling:
            if self.data_plane is not None:
                await self.data_plane.handle(frames)

    def request_stop(self) -> None:
        self.service.request_stop()

    async def wait_for_termination(self) -> None:
        """Block until a stop is requested (SIGTERM, `request_stop`), then drain and close."""
        await self.service.wait_for_termination()
        await self._close_data_plane()

    async def stop(self, grace_s: float = 1.0) -> None:
        self.service.grace_s = grace_s
        self.request_stop()
        await self.wait_for_termination()

    async def _close_data_plane(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._handling:  # between two messages: none is half served
            if self._loop_task is not None:
                self._loop_task.cancel()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self.runner is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.runner.close)
            self.runner.publisher.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes the ROUTER (and anything a failed start left)
        logger.info("kvstore data plane closed")


async def serve(config: KVStoreConfig, *, install_signal_handlers: bool = False) -> KVStoreServer:
    """Start a kvstore in this event loop; returns it SERVING, with its bound addresses."""
    server = KVStoreServer(config)
    if install_signal_handlers:
        server.service.install_signal_handlers()
    try:
        await server.start()
    except BaseException:
        await server.stop(grace_s=0)
        raise
    return server
