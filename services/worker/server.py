"""The worker service: the `llmfleet.v1.Worker` servicer around one engine core (any role).

    server = await serve(WorkerConfig(role="decode"), EngineConfig(...))   # SERVING when warm
    ... server.address, server.kv_endpoint, server.kv_events_endpoint ...
    await server.stop()                                                   # drain and close

Threads of control (all on one asyncio loop, except the engine step on a worker thread):
  - RPC handlers convert protobuf at the boundary and queue engine work on the `EngineLoop`;
  - the engine loop steps and, after each iteration, pushes `TokenBatch`es, publishes KV events,
    completes prefill waiters and starts kvstore puts;
  - decode side: the `KVReceiver` writes pushed blocks into lease reservations (via the loop),
    a sweeper expires leases and frees their blocks;
  - the `Registrar` registers and heartbeats with the scheduler;
  - kvstore: before admission a longer prefix held by the kvstore is fetched and imported
    into the prefix cache; once a prompt is computed its full blocks the kvstore lacked are put.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass

import grpc
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2

from llmfleet.services.worker.engine.engine import LLMEngine, RequestOutput
from llmfleet.services.worker.engine.sampling_params import SamplingParams
from llmfleet.services.worker.kv_transfer import KVPusher, KVReceiver
from llmfleet.services.worker.lease import LeaseError, LeaseTable
from llmfleet.services.worker.loop import EngineLoop
from llmfleet.services.worker.models.loader import LoadedModel, load_model
from llmfleet.services.worker.outputs import (
    GENERATION_TOKENS,
    KV_USAGE,
    PREFIX_HITS,
    PREFIX_QUERIES,
    PROMPT_TOKENS,
    ReplySinks,
)
from llmfleet.services.worker.registration import Registrar
from llmfleet.shared.block_hash import HashContext, hash_block_chain
from llmfleet.shared.config import EngineConfig, WorkerConfig
from llmfleet.shared.convert import logprobs_to_pb, model_info_to_pb, sampling_from_pb
from llmfleet.shared.errors import LLMFleetError, ValidationError
from llmfleet.shared.kv_events import KVEventPublisher
from llmfleet.shared.kvstore_client import KVStoreClient
from llmfleet.shared.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from llmfleet.shared.service import FailedPrecondition, Service, abort_with
from llmfleet.shared.transport import (
    Frame,
    MalformedFrame,
    bind,
    dtype_name,
    frame_tensor,
    kv_layout_key,
    tensor_frame,
)
from llmfleet.v1 import (
    common_pb2,
    dataplane_pb2,
    registry_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = "llmfleet.v1.Worker"
ROLE_TO_PB = {
    "unified": common_pb2.WORKER_ROLE_UNIFIED,
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}


class Cancelled(LLMFleetError):
    """The request was cancelled while the RPC waited for it."""


@dataclass
class WorkerCounters:
    kvstore_blocks_fetched: int = 0
    kvstore_blocks_stored: int = 0
    prefix_queries_reported: int = 0  # already added to the Prometheus counters
    prefix_hits_reported: int = 0


class WorkerServer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_config: WorkerConfig,
        engine_config: EngineConfig,
        loaded_model: LoadedModel | None = None,
        *,
        grace_s: float = 10.0,
    ) -> None:
        self.wc = worker_config
        self.ec = engine_config
        self._loaded = loaded_model
        self.grace_s = grace_s
        self.service = Service(
            "worker",
            worker_config.host,
            worker_config.port,
            metrics_port=worker_config.metrics_port,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.service.server)
        self.worker_id = worker_config.worker_id or ""
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.leases = LeaseTable()
        self.counters = WorkerCounters()
        self.kv_endpoint = ""
        self.kv_events_endpoint = ""
        self._ctx = zmq.asyncio.Context()
        self._routes: dict[str, str] = {}  # request id -> reply endpoint
        self._prefills: dict[str, asyncio.Future[RequestOutput]] = {}
        self._kv_puts: dict[str, list[bytes]] = {}  # request id -> hashes the kvstore lacks
        self._tasks: set[asyncio.Task[None]] = set()
        self._bg: list[asyncio.Task[None]] = []
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.publisher: KVEventPublisher | None = None
        self.sinks: ReplySinks | None = None
        self.pusher: KVPusher | None = None
        self.receiver: KVReceiver | None = None
        self.kvstore: KVStoreClient | None = None
        self.registrar: Registrar | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.service.address

    @property
    def role(self) -> str:
        return self.wc.role

    async def start(self) -> None:
        await self.service.start([SERVICE_NAME])  # NOT_SERVING while the model loads
        if not self.worker_id:
            self.worker_id = f"worker-{self.address}-{os.getpid()}"
        loaded = self._loaded
        if loaded is None:
            ec = self.ec
            loaded = await asyncio.to_thread(
                load_model, ec.model, dtype=ec.torch_dtype, device=ec.device
            )
        self._loaded = None  # the engine owns it now
        engine = self.engine = LLMEngine(self.ec, loaded)
        engine.drain_kv_events()  # turns event recording on
        self.model_name = engine.info.model_id
        L, _, bs, H, D = engine.kv_block_shape
        dtype = dtype_name(engine.kv_dtype)
        self.kv_layout = dataplane_pb2.KVLayout(
            num_layers=L, block_size=bs, num_kv_heads=H, head_dim=D, dtype=dtype
        )
        self.kv_layout_key = kv_layout_key(engine.info.model_id, L, bs, H, D, dtype)

        self.publisher = KVEventPublisher(self._ctx, self.wc.host, self.worker_id)
        self.kv_events_endpoint = self.publisher.endpoint
        self.sinks = ReplySinks(self._ctx, self.worker_id)
        self.loop = EngineLoop(engine, self._on_iteration)
        self.loop.start()
        if self.role in ("prefill", "unified"):
            self.pusher = KVPusher(self._ctx)
        if self.role in ("decode", "unified"):
            sock, self.kv_endpoint = bind(self._ctx, zmq.ROUTER, self.wc.host)
            self.receiver = KVReceiver(sock, self._on_push)
            self.receiver.start()
            self._bg.append(asyncio.create_task(self._sweep_leases(), name="lease-sweeper"))
        if self.wc.kvstore_address and self.wc.kvstore_endpoint:
            self.kvstore = KVStoreClient(
                self.wc.kvstore_address, self.wc.kvstore_endpoint, ctx=self._ctx
            )
        if self.wc.scheduler_address:
            self.registrar = Registrar(
                self.wc.scheduler_address, self._register_request, self._load_report
            )
            self.registrar.start()
            self._bg.append(asyncio.create_task(self._serve_when_registered()))
        else:
            await self.service.set_serving()
        logger.info(
            "worker %s (%s) serving %s on %s kv_endpoint=%s kv_events=%s",
            self.worker_id,
            self.role,
            self.model_name,
            self.address,
            self.kv_endpoint or "-",
            self.kv_events_endpoint,
        )

    async def _serve_when_registered(self) -> None:
        if self.registrar is not None:
            await self.registrar.registered.wait()
            if not self._stopped:
                await self.service.set_serving()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def wait_for_termination(self) -> None:
        await self._stop_requested.wait()
        await self.stop()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, deregister, let in-flight requests finish within the grace period
        (abort the rest), then close the server and every socket."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.grace_s if grace_s is None else grace_s
        for name in ["", SERVICE_NAME]:
            await self.service.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._bg:
            task.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.registrar is not None:
            await self.registrar.close()
        if self.loop is not None and self.engine is not None:
            engine = self.engine
            try:
                await asyncio.wait_for(self.loop.wait_idle(), grace)
            except TimeoutError:
                logger.warning("drain: aborting requests still running after %.1f s", grace)
            for lease in self.leases.active():
                self.leases.release(lease.lease_id, lease.epoch)
                self.loop.call_soon(engine.release_reserved, lease.lease_id)
            await self.loop.call(lambda: [engine.abort(r) for r in engine.request_ids()])
            try:  # let the abort outputs reach their requesters
                await asyncio.wait_for(self.loop.wait_idle(), 1.0)
            except TimeoutError:
                pass
        self.service.grace_s = 0.5
        self.service.request_stop()
        await self.service.wait_for_termination()
        if self.loop is not None:
            await self.loop.stop()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.receiver is not None:
            await self.receiver.stop()
        if self.pusher is not None:
            await self.pusher.close()
        if self.kvstore is not None:
            await self.kvstore.close()
        if self.sinks is not None:
            self.sinks.close()
        if self.publisher is not None:
            self.publisher.close()
        self._ctx.destroy(linger=0)
        logger.info("worker %s stopped", self.worker_id)

    # ---- engine loop callback ----------------------------------------------------------------
    async def _on_iteration(self, step: int, outputs: list[RequestOutput]) -> None:
        engine = self.engine
        if engine is None or self.publisher is None or self.sinks is None:
            return
        to_send: list[RequestOutput] = []
        num_generated = 0
        for out in outputs:
            num_generated += len(out.new_token_ids)
            if out.request_id in self._kv_puts:
                self._start_kv_put(out)
            fut = self._prefills.get(out.request_id)
            if fut is not None:
                if not fut.done():
                    fut.set_result(out)
                continue
            to_send.append(out)
        # Read everything needed from the engine before the first await (a step may follow).
        stored, removed = engine.drain_kv_events()
        done = [o.request_id for o in to_send if o.finished]
        self._update_metrics(num_generated)
        if to_send:
            await self.sinks.send(step, to_send, self._routes)
        for rid in done:
            if not engine.has_request(rid):
                self._routes.pop(rid, None)
        await self.publisher.publish(stored, removed)

    def _update_metrics(self, num_generated: int) -> None:
        engine, name, c = self.engine, self.model_name, self.counters
        if engine is None:
            return
        NUM_REQUESTS_RUNNING.labels(name).set(engine.num_running)
        NUM_REQUESTS_WAITING.labels(name).set(engine.num_waiting)
        KV_USAGE.labels(name).set(engine.block_manager.usage)
        if num_generated:
            GENERATION_TOKENS.labels(name).inc(num_generated)
        stats = engine.block_manager.stats
        if stats.num_queries > c.prefix_queries_reported:
            PREFIX_QUERIES.labels(name).inc(stats.num_queries - c.prefix_queries_reported)
            c.prefix_queries_reported = stats.num_queries
        if stats.num_hits > c.prefix_hits_reported:
            PREFIX_HITS.labels(name).inc(stats.num_hits - c.prefix_hits_reported)
            c.prefix_hits_reported = stats.num_hits

    # ---- kvstore -----------------------------------------------------------------------------
    async def _fetch_prefix(self, hashes: list[bytes]) -> int | None:
        """Import the kvstore's part of the chain beyond the local prefix cache.

        Returns how many leading blocks the kvstore holds (None: no kvstore, or unreachable;
        the request then runs without it)."""
        if self.kvstore is None or self.loop is None or self.engine is None or not hashes:
            return None
        engine = self.engine
        try:
            num_local = await self.loop.call(engine.num_cached_prefix_blocks, hashes)
            num_remote = await self.kvstore.lookup(self.kv_layout_key, hashes)
            if num_remote > num_local:
                frames = await self.kvstore.get(self.kv_layout_key, hashes[:num_remote])
                shape, dtype = engine.kv_block_shape, engine.kv_dtype
                payload = torch.stack([frame_tensor(f, dtype, shape) for f in frames])
                got = hashes[: len(frames)]
                imported = await self.loop.call(engine.import_cached_blocks, got, payload)
                self.counters.kvstore_blocks_fetched += imported
            return num_remote
        except (LLMFleetError, MalformedFrame) as e:
            logger.warning("kvstore unavailable for a prefix fetch: %s", e)
            return None

    def _start_kv_put(self, out: RequestOutput) -> None:
        """Once a prompt is computed (its first output), put the blocks the kvstore lacks.

        Called between steps, so the blocks are read before anything can evict them."""
        hashes = self._kv_puts.pop(out.request_id)
        if not out.new_token_ids or self.engine is None or self.kvstore is None:
            return  # aborted before its prompt was computed
        payload = self.engine.read_cached_blocks(hashes)
        if payload is None:
            logger.debug("prompt blocks of %s left the cache before the put", out.request_id)
            return
        kvstore, key = self.kvstore, self.kv_layout_key

        async def put() -> None:
            try:
                frames = [tensor_frame(payload[i]) for i in range(payload.shape[0])]
                await kvstore.put(key, hashes, frames)
                self.counters.kvstore_blocks_stored += len(hashes)
            except LLMFleetError as e:
                logger.warning("kvstore put of %d blocks failed: %s", len(hashes), e)

        task = asyncio.create_task(put())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- admission ---------------------------------------------------------------------------
    async def _admit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str,
        *,
        reply_endpoint: str | None,
        prefill_only: bool,
    ) -> int:
        """Validate, fetch a kvstore prefix, admit; returns the prompt tokens found cached."""
        engine, loop = self._engine_loop()
        await loop.call(engine.validate_request, request_id, prompt, params)
        hashes = hash_block_chain(
            prompt, self.ec.block_size, HashContext(engine.info.model_id, cache_salt)
        )
        num_remote = await self._fetch_prefix(hashes)

        def admit() -> int:
            num_cached = engine.num_cached_prefix_blocks(hashes)
            engine.add_request(
                request_id, prompt, params, cache_salt=cache_salt, prefill_only=prefill_only
            )
            if reply_endpoint:
                self._routes[request_id] = reply_endpoint
            if num_remote is not None and num_remote < len(hashes):
                self._kv_puts[request_id] = hashes[num_remote:]
            return num_cached

        num_cached_blocks = await loop.call(admit)
        PROMPT_TOKENS.labels(self.model_name).inc(len(prompt))
        tokens = num_cached_blocks * self.ec.block_size
        return max(0, tokens - self.ec.block_size) if tokens >= len(prompt) else tokens

    def _engine_loop(self) -> tuple[LLMEngine, EngineLoop]:
        if self.engine is None or self.loop is None or self._stopped:
            raise FailedPrecondition("the worker is not serving")
        return self.engine, self.loop

    def _require_role(self, rpc: str, *roles: str) -> None:
        if self.role not in roles:
            raise FailedPrecondition(
                f"{rpc} needs a {' or '.join(roles)} worker; this one is {self.role}"
            )

    # ---- RPCs --------------------------------------------------------------------------------
    async def AddRequest(
        self, request: worker_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AddRequestResponse:
        try:
            if not request.reply_endpoint:
                raise ValidationError("reply_endpoint", "must be set")
            params = sampling_from_pb(request.sampling)
            num_cached = await self._admit(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.cache_salt,
                reply_endpoint=request.reply_endpoint,
                prefill_only=False,
            )
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.AddRequestResponse(num_cached_tokens=num_cached)

    async def Cancel(
        self, request: worker_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelResponse:
        try:
            engine, loop = self._engine_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        index = request.index if request.HasField("index") else None
        stop = request.stop_string if request.reason == common_pb2.FINISH_REASON_STOP else None
        rid = request.request_id

        def cancel() -> bool:
            found = engine.cancel(rid, index, stop)
            # Aborts emit a final output, whose delivery drops the route; a stop does not.
            if stop is not None and not engine.has_request(rid):
                self._routes.pop(rid, None)
            return found

        return worker_pb2.CancelResponse(found=await loop.call(cancel))

    def _load_report(self) -> common_pb2.LoadReport:
        engine = self.engine
        if engine is None:
            return common_pb2.LoadReport()
        return common_pb2.LoadReport(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.block_manager.num_blocks,
            num_active_leases=len(self.leases),
        )

    async def GetWorkerStats(
        self, request: worker_pb2.GetWorkerStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerStatsResponse:
        try:
            engine, loop = self._engine_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        self._reap_leases()
        load = await loop.call(self._load_report)  # between steps: a consistent view
        stats = engine.block_manager.stats
        return worker_pb2.GetWorkerStatsResponse(
            worker_id=self.worker_id,
            role=ROLE_TO_PB[self.role],
            load=load,
            prefix_cache_queries=stats.num_queries,
            prefix_cache_hits=stats.num_hits,
            kvstore_blocks_fetched=self.counters.kvstore_blocks_fetched,
            kvstore_blocks_stored=self.counters.kvstore_blocks_stored,
        )

    async def GetKVSnapshot(
        self, request: worker_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetKVSnapshotResponse:
        if self.publisher is None:
            await abort_with(context, FailedPrecondition("the worker is not serving"))
        seq, hashes = self.publisher.snapshot()
        return worker_pb2.GetKVSnapshotResponse(
            publisher_id=self.worker_id, seq=seq, block_hashes=hashes
        )

    # ---- decode side: leases ------------------------------------------------------------------
    async def ReserveKV(
        self, request: worker_pb2.ReserveKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReserveKVResponse:
        try:
            self._require_role("ReserveKV", "decode", "unified")
            engine, loop = self._engine_loop()
            if not request.request_id:
                raise ValidationError("request_id", "must not be empty")
            if request.num_prompt_tokens < 1:
                raise ValidationError("num_prompt_tokens", "must be >= 1")
            if request.ttl_ms < 0:
                raise ValidationError("ttl_ms", f"must be >= 0, got {request.ttl_ms}")
            self._reap_leases()
            ttl_ms = request.ttl_ms or self.wc.lease_ttl_ms
            num_blocks = engine.block_manager.blocks_needed(request.num_prompt_tokens)
            lease = self.leases.grant(
                request.request_id, request.num_prompt_tokens, num_blocks, ttl_ms / 1000
            )
            try:
                await loop.call(engine.reserve, lease.lease_id, request.num_prompt_tokens)
            except BaseException:
                self.leases.release(lease.lease_id, lease.epoch)
                raise
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.ReserveKVResponse(
            lease=worker_pb2.KVLease(
                lease_id=lease.lease_id,
                epoch=lease.epoch,
                expires_at_unix_ms=lease.expires_at_ms,
                kv_endpoint=self.kv_endpoint,
                num_blocks=lease.num_blocks,
            )
        )

    async def _on_push(self, header: dataplane_pb2.KVTransferHeader, frames: list[Frame]) -> None:
        """A KV push for a lease: validated, then written into the reservation (between steps).
        Raises LeaseError / MalformedFrame to reject it (the receiver acks ok=false)."""
        engine, loop = self._engine_loop()
        self._reap_leases()
        lease = self.leases.check_push(
            header.lease_id, header.epoch, header.first_block, len(frames)
        )
        if header.request_id != lease.request_id:
            raise LeaseError(f"lease {lease.lease_id} is not for request {header.request_id!r}")
        if header.layout != self.kv_layout:
            raise LeaseError(f"KV layout {header.layout} is not this worker's {self.kv_layout}")
        shape, dtype = engine.kv_block_shape, engine.kv_dtype
        payload = torch.stack([frame_tensor(f, dtype, shape) for f in frames])
        try:
            await loop.call(engine.write_reserved, lease.lease_id, header.first_block, payload)
        except KeyError:
            raise LeaseError(f"lease {lease.lease_id} was released") from None
        self.leases.record_push(lease, header.first_block, len(frames))

    async def StartDecode(
        self, request: worker_pb2.StartDecodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StartDecodeResponse:
        try:
            self._require_role("StartDecode", "decode", "unified")
            engine, loop = self._engine_loop()
            if not request.reply_endpoint:
                raise ValidationError("reply_endpoint", "must be set")
            params = sampling_from_pb(request.sampling)
            prompt = list(request.prompt_token_ids)
            self._reap_leases()
            try:
                lease = self.leases.get(request.lease_id, request.epoch)
                if lease.num_prompt_tokens != len(prompt):
                    raise ValidationError(
                        "prompt_token_ids",
                        f"{len(prompt)} tokens, the lease was for {lease.num_prompt_tokens}",
                    )
                self.leases.commit(request.lease_id, request.epoch, request.request_id)
            except LeaseError as e:
                self._reap_leases()
                raise FailedPrecondition(str(e)) from None
            rid = request.request_id

            def start() -> None:
                # Routed first: a first token that already ends the sequence emits its final
                # output from start_decode itself, and that output must reach the requester.
                self._routes[rid] = request.reply_endpoint
                try:
                    engine.start_decode(
                        lease.lease_id,
                        rid,
                        prompt,
                        request.first_token_id,
                        params,
                        cache_salt=request.cache_salt,
                    )
                except BaseException:
                    self._routes.pop(rid, None)
                    engine.release_reserved(lease.lease_id)
                    raise

            await loop.call(start)
        except LLMFleetError as e:
            await abort_with(context, e)
        return worker_pb2.StartDecodeResponse()

    async def ReleaseKV(
        self, request: worker_pb2.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseKVResponse:
        try:
            engine, loop = self._engine_loop()
        except LLMFleetError as e:
            await abort_with(context, e)
        self._reap_leases()
        lease = self.leases.release(request.lease_id, request.epoch)
        if lease is None:
            return worker_pb2.ReleaseKVResponse(released=False)
        await loop.call(engine.release_reserved, lease.lease_id)
        return worker_pb2.ReleaseKVResponse(released=True)

    def _reap_leases(self) -> None:
        """Free the blocks of every lease that expired (sweeper, and before lease operations)."""
        if self.engine is None or self.loop is None:
            return
        for lease in self.leases.expire():
            logger.info("lease %s of request %s expired", lease.lease_id, lease.request_id)
            self.loop.call_soon(self.engine.release_reserved, lease.lease_id)

    async def _sweep_leases(self) -> None:
        period = min(0.25, max(0.01, self.wc.lease_ttl_ms / 10_000))
        while True:
            await asyncio.sleep(period)
            self._reap_leases()

    # ---- prefill side --------------------------------------------------------------------------
    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        try:
            self._require_role("Prefill", "prefill", "unified")
            engine, loop = self._engine_loop()
            lease = request.lease
            if not lease.lease_id:
                raise ValidationError("lease.lease_id", "must be set")
            if not lease.kv_endpoint:
                raise ValidationError("lease.kv_endpoint", "must be set")
            if lease.expires_at_unix_ms and lease.expires_at_unix_ms <= time.time() * 1000:
                raise FailedPrecondition(f"lease {lease.lease_id} expired before the prefill")
            if rid in self._prefills:
                raise ValidationError("request_id", f"{rid!r} is already in use")
            params = sampling_from_pb(request.sampling)
            prompt = list(request.prompt_token_ids)
            fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
            self._prefills[rid] = fut
            admitted = False
            try:
                await self._admit(
                    rid, prompt, params, request.cache_salt, reply_endpoint=None, prefill_only=True
                )
                admitted = True
                out = await fut
                if out.finish_reason == "abort" or not out.new_token_ids:
                    raise Cancelled(f"request {rid} was cancelled during its prefill")
                payload = await loop.call(lambda: engine.read_blocks(engine.pinned_block_ids(rid)))
                if lease.num_blocks and payload.shape[0] != lease.num_blocks:
                    raise FailedPrecondition(
                        f"the prompt has {payload.shape[0]} blocks, the lease {lease.num_blocks}"
                    )
                if self.pusher is None:
                    raise FailedPrecondition("this worker has no KV pusher")
                pushed = await self.pusher.push(
                    lease.kv_endpoint,
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    request_id=rid,
                    layout=self.kv_layout,
                    payload=payload,
                    timeout_s=self.wc.kv_push_timeout_ms / 1000,
                )
            finally:
                self._prefills.pop(rid, None)
                if admitted:
                    loop.call_soon(engine.abort, rid)  # releases the pinned blocks
        except Cancelled as e:
            await context.abort(grpc.StatusCode.CANCELLED, str(e))
        except LLMFleetError as e:
            await abort_with(context, e)
        first_lp = out.new_logprobs[0] if out.new_logprobs else None
        resp = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            kv_bytes=pushed.num_bytes,
            kv_transfer_us=pushed.transfer_us,
            finished=out.finish_reason in ("stop", "length"),
        )
        if first_lp is not None:
            resp.first_logprobs.CopyFrom(logprobs_to_pb(first_lp))
        return resp

    def _register_request(self) -> registry_pb2.RegisterWorkerRequest:
        engine = self.engine
        if engine is None:
            raise FailedPrecondition("the worker is not serving")
        return registry_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id,
            role=ROLE_TO_PB[self.role],
            address=self.address,
            kv_events_endpoint=self.kv_events_endpoint,
            model=model_info_to_pb(
                engine.info,
                max_model_len=engine.max_model_len,
                max_n=self.ec.max_n,
                max_logprobs=self.ec.max_logprobs,
                block_size=self.ec.block_size,
            ),
            load=self._load_report(),
        )


async def serve(
    worker_config: WorkerConfig,
    engine_config: EngineConfig,
    loaded_model: LoadedModel | None = None,
    *,
    install_signal_handlers: bool = False,
    grace_s: float = 10.0,
) -> WorkerServer:
    """Start a worker in this event loop; returns it once started (SERVING once the model is
    loaded and, with a scheduler configured, registered)."""
    server = WorkerServer(worker_config, engine_config, loaded_model, grace_s=grace_s)
    if install_signal_handlers:
        server.install_signal_handlers()
    try:
        await server.start()
    except BaseException:
        await server.stop(grace_s=0)
        raise
    return server
