"""A worker's runtime: its engine core and everything around it, from start to drain.

    runtime.start() / runtime.stop()   # load, serve, register / drain (queue moves), close

Threads of control (all on one asyncio loop, except the torch work: every engine op and step
runs on the one `EngineThread`, see loop.py):
  - RPC handlers (server.py) convert protobuf at the boundary and queue engine work on the
    `EngineLoop`; requests enter the engine through `Admission` (admission.py: images' pixels);
  - the engine loop steps; right after each step the engine thread itself pushes the new tokens
    (`TokenBatch`es); after each iteration the event loop publishes KV events, completes
    prefill waiters and starts kvstore puts;
  - decode side (decode_side.py): the `KVReceiver` writes pushed blocks into lease
    reservations (via the loop), a sweeper expires leases and frees their blocks;
  - prefill side (prefill_side.py): a prefill waits for its first output, then pushes its KV;
  - the `Registrar` registers and heartbeats with the router;
  - kvstore (kvstore_sync.py): before admission a longer prefix the kvstore holds is fetched
    into the prefix cache; once a prompt is computed its blocks the kvstore lacked are put.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.request import RequestOutput
from llmfleet.models.loader import LoadedModel
from llmfleet.services.worker.admission import Admission
from llmfleet.services.worker.decode_side import DecodeSide
from llmfleet.services.worker.failure import ForwardPassFailed, describe, hand_back
from llmfleet.services.worker.kv_transfer import KVPusher
from llmfleet.services.worker.kvstore_client import KVStoreClient
from llmfleet.services.worker.kvstore_sync import KVStoreSync
from llmfleet.services.worker.loop import EngineLoop, EngineThread
from llmfleet.services.worker.outputs import IterationFacts, ReplySinks, WorkerCounters, load_report
from llmfleet.services.worker.prefill_side import PrefillSide
from llmfleet.services.worker.registration import Registrar
from llmfleet.services.worker.request_spans import RequestSpans
from llmfleet.shared.core.config import EngineConfig, WorkerConfig
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.convert import ROLE_TO_PB, model_info_to_pb
from llmfleet.shared.wire.kv_events import KVEventPublisher
from llmfleet.shared.wire.media import MediaClient
from llmfleet.shared.wire.service import FailedPrecondition, Service, Unavailable
from llmfleet.shared.wire.transport import bind, dtype_name, kv_layout_key, reachable_host
from llmfleet.v1 import common_pb2, dataplane_pb2, registry_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = "llmfleet.v1.Worker"


class WorkerRuntime:
    """One worker's engine, sockets and peers, from start to drain (the servicer is server.py)."""

    def __init__(
        self,
        worker_config: WorkerConfig,
        engine_config: EngineConfig,
        loaded_model: LoadedModel | None = None,
        *,
        grace_s: float = 30.0,
    ) -> None:
        self.wc = worker_config
        self.ec = engine_config
        self._loaded = loaded_model
        self.grace_s = grace_s
        self.tls = tls.load(worker_config.tls_dir)
        self.service = Service(
            "worker",
            worker_config.host,
            worker_config.port,
            metrics_port=worker_config.metrics_port,
            tls=self.tls,
        )
        self.worker_id = worker_config.worker_id or ""
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.engine_thread = EngineThread()
        self.counters = WorkerCounters()
        self._facts: IterationFacts | None = None
        self.kv_endpoint = self.kv_events_endpoint = ""
        self._ctx = tls.zmq_context(self.tls)  # with tls: every socket speaks CURVE
        self._routes: dict[str, str] = {}  # request id -> reply endpoint
        self._bg: list[asyncio.Task[None]] = []
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.failure: str | None = None  # why the forward pass failed (failure.py)
        self._draining = False  # new work is refused (UNAVAILABLE); running requests go on
        self.publisher: KVEventPublisher | None = None
        self.sinks: ReplySinks | None = None
        self.decode: DecodeSide | None = None  # decode and unified roles
        self.prefill: PrefillSide | None = None  # prefill and unified roles
        self.kvstore: KVStoreSync | None = None  # with a kvstore configured
        self.registrar: Registrar | None = None
        self.request_spans = RequestSpans(self.worker_id)
        self.admission = Admission(  # (its media client: pixels of images, CURVE with tls)
            self._engine_loop, self._routes, self.request_spans, block_size=engine_config.block_size
        )
        self.admission.media = MediaClient(ctx=self._ctx)

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Where the router and peers reach this worker's gRPC (its registered address)."""
        return f"{reachable_host(self.wc.host, self.wc.advertise_host)}:{self.service.port}"

    @property
    def role(self) -> str:
        return self.wc.role

    @property
    def pusher(self) -> KVPusher | None:
        return self.prefill.pusher if self.prefill is not None else None

    async def start(self) -> None:
        await self.service.start([SERVICE_NAME])  # NOT_SERVING while the model loads
        if not self.worker_id:
            self.worker_id = f"worker-{self.address}-{os.getpid()}"
        self.request_spans.worker_id = self.worker_id
        loaded = self._loaded
        thread = self.engine_thread  # every torch op of this process runs there (loop.py)
        if loaded is None:
            loaded = await thread.run(load_for, self.ec)
        self._loaded = None  # the engine owns it now
        engine = self.engine = await thread.run(LLMEngine, self.ec, loaded)
        engine.kv.drain_events()  # turns event recording on
        self.model_name = engine.spec.model_id
        L, _, bs, H, D = engine.kv.block_shape
        dtype = dtype_name(engine.kv.dtype)
        self.kv_layout = dataplane_pb2.KVLayout(
            num_layers=L, block_size=bs, num_kv_heads=H, head_dim=D, dtype=dtype
        )
        self.kv_layout_key = kv_layout_key(engine.spec.model_id, L, bs, H, D, dtype)

        self.publisher = KVEventPublisher(
            self._ctx, self.wc.host, self.worker_id, advertise_host=self.wc.advertise_host
        )
        self.kv_events_endpoint = self.publisher.endpoint
        self.sinks = ReplySinks(self._ctx, self.worker_id)
        # A CPU forward pass takes every core; a GPU's or a simulated one leaves them free.
        on_cpu = engine.device.type == "cpu" and not engine.simulated
        yield_s = self.wc.first_token_yield_ms / 1e3 if on_cpu else 0.0
        self.loop = EngineLoop(
            engine,
            self._on_iteration,
            thread,
            first_token_yield_s=yield_s,
            on_step=self._push,
            collect=self._collect,
            on_failure=self._on_engine_failure,
            fault_inject_step=self.wc.fault_inject_step,
        )
        self.loop.start()
        if self.role in ("prefill", "unified"):
            self.prefill = PrefillSide(
                self._ctx,
                self._engine_loop,
                self.admission.admit_prefill,
                self.kv_layout,
                kv_push_timeout_ms=self.wc.kv_push_timeout_ms,
                kv_transfer=self.wc.kv_transfer,
            )
        if self.role in ("decode", "unified"):
            sock, self.kv_endpoint = bind(
                self._ctx, zmq.ROUTER, self.wc.host, 0, self.wc.advertise_host
            )
            self.decode = DecodeSide(
                self._engine_loop,
                self.kv_layout,
                sock,
                self.kv_endpoint,
                self._routes,
                self.request_spans,
                lease_ttl_ms=self.wc.lease_ttl_ms,
            )
            self.decode.start()
        if self.wc.kvstore_address and self.wc.kvstore_endpoint:
            client = KVStoreClient(
                self.wc.kvstore_address, self.wc.kvstore_endpoint, ctx=self._ctx, tls=self.tls
            )
            self.kvstore = KVStoreSync(
                client,
                engine,
                self.loop,
                self.kv_layout_key,
                ctx=self._ctx,
                events_endpoint=self.wc.kvstore_events_endpoint,
                put_delay_s=self.wc.kvstore_put_delay_ms / 1000,
                max_put_bytes=self.wc.kvstore_put_max_bytes,
            )
            self.admission.kvstore = self.kvstore
            await self.kvstore.start()
        if self.wc.router_address:
            self.registrar = Registrar(
                self.wc.router_address, self._register_request, self._load_report, tls=self.tls
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
            if not self._stopped and self.failure is None:
                await self.service.set_serving()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_requested.set)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def wait_for_termination(self) -> None:
        await self._stop_requested.wait()
        await self.stop(0 if self.failure else None)
        if self.failure is not None:
            raise ForwardPassFailed(self.failure)

    def _on_engine_failure(self, error: BaseException) -> None:
        """On the event loop, once: a step raised (loop.py). Hand the requests back (failure.py),
        then stop at once; `wait_for_termination` raises ForwardPassFailed (the process exits 1)."""
        self.failure = reason = describe(error)
        task = asyncio.create_task(hand_back(reason, self.service, self.prefill, self.registrar))
        task.add_done_callback(lambda _: self._stop_requested.set())
        self._bg.append(task)  # (done before `stop` cancels what remains of these)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (NOT_SERVING; the router moves the queue elsewhere if another worker takes new
        requests, and then new work is refused: UNAVAILABLE; running requests finish within the
        grace, the rest are aborted), deregister, close the server and every socket."""
        if self._stopped:
            return
        self._stopped = True
        self._draining = self.registrar is None  # else as the router answers (below)
        grace = self.grace_s if grace_s is None else grace_s
        for name in ["", SERVICE_NAME]:
            await self.service.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._bg:
            task.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.decode is not None:
            await self.decode.stop_sweeping()
        if self.loop is not None and self.engine is not None:
            engine = self.engine
            if self.registrar is not None and self.failure is None:  # (failed: handed back)
                queued = await self.loop.call(_queued_request_ids, engine)
                # Until the router has this notice (it may be moving another draining worker's
                # queue here), and if this is the last of its role, new requests are taken in.
                moved, replaced = await self.registrar.drain(queued)
                self._draining = replaced
                logger.info("drain: %d queued requests moved to other workers", len(moved))
                await self.loop.call(lambda: [engine.abort(r) for r in moved])
            try:
                await asyncio.wait_for(self.loop.wait_idle(), grace)
            except TimeoutError:
                logger.warning("drain: aborting requests still running after %.1f s", grace)
            if self.decode is not None:
                self.decode.release_all(self.loop, engine)
            await self.loop.call(lambda: [engine.abort(r) for r in engine.request_ids()])
            try:  # let the abort outputs reach their requesters
                await asyncio.wait_for(self.loop.wait_idle(), 1.0)
            except TimeoutError:
                pass
        if self.registrar is not None:
            await self.registrar.close()
        self.service.grace_s = 0.5
        self.service.request_stop()
        await self.service.wait_for_termination()
        if self.loop is not None:
            await self.loop.stop()
        if self.sinks is not None:  # on the engine thread, after any iteration still running
            try:
                await asyncio.wait_for(self.engine_thread.run(self.sinks.close), 5.0)
            except TimeoutError:  # a wedged step: close here (unclosed sockets block destroy)
                logger.warning("engine thread busy at stop; closing reply sockets from the loop")
                self.sinks.close()
        self.engine_thread.shutdown()
        self.request_spans.close()
        if self.kvstore is not None:
            await self.kvstore.close()
        await self.admission.close()
        if self.decode is not None:
            await self.decode.close()
        if self.prefill is not None:
            await self.prefill.close()
        if self.publisher is not None:
            self.publisher.close()
        self._ctx.destroy(linger=0)
        logger.info("worker %s stopped", self.worker_id)

    # ---- engine loop callbacks ---------------------------------------------------------------
    def _push(self, step: int, outputs: list[RequestOutput]) -> None:
        """On the engine thread, right after the step: the new tokens to their requesters.
        Routes are only touched between steps (engine ops, `_on_iteration`), never during."""
        if self.sinks is not None:
            self.sinks.send(step, outputs, self._routes)

    def _collect(self, step: int, outputs: list[RequestOutput]) -> IterationFacts:
        """On the engine thread, after an iteration (see IterationFacts)."""
        assert self.engine is not None and self.loop is not None
        spans = self.request_spans.following
        return IterationFacts.read(self.engine, outputs, self.loop.step_started_ns, spans)

    async def _on_iteration(
        self, step: int, outputs: list[RequestOutput], facts: IterationFacts | None
    ) -> None:
        if facts is None or self.publisher is None:
            return
        self._facts = facts  # the latest, for load reports
        num_generated = 0
        spans = self.request_spans if len(self.request_spans) else None
        if spans is not None:
            spans.on_step(facts.running, facts.started_ns)
        for out in outputs:
            num_generated += len(out.new_token_ids)
            if spans is not None:
                spans.on_output(out, facts.started_ns)
            if self.kvstore is not None:
                self.kvstore.on_output(out)
            if self.prefill is not None:
                self.prefill.take(out)  # a prefill-only request's output (it has no route)
        self.counters.report(self.model_name, num_generated, facts)
        for rid in facts.ended:
            self._routes.pop(rid, None)
        await self.publisher.publish(facts.stored, facts.removed)

    # ---- access ------------------------------------------------------------------------------
    def _engine_loop(self) -> tuple[LLMEngine, EngineLoop]:
        """The engine, for new work: refused while draining or failed (UNAVAILABLE)."""
        if self.failure is not None or self._draining:
            raise Unavailable(self.failure or "the worker is draining")
        return self._running_loop()

    def _running_loop(self) -> tuple[LLMEngine, EngineLoop]:
        """The engine, for requests it already has (cancel, stats, release): also in a drain."""
        if self.engine is None or self.loop is None:
            raise FailedPrecondition("the worker is not serving")
        return self.engine, self.loop

    def _require_role(self, rpc: str, *roles: str) -> None:
        if self.role not in roles:
            raise FailedPrecondition(
                f"{rpc} needs a {' or '.join(roles)} worker; this one is {self.role}"
            )

    # ---- the router's view of this worker ------------------------------------------------
    def _load_report(self) -> common_pb2.LoadReport:
        engine = self.engine
        if engine is None:
            return common_pb2.LoadReport()
        kvstore = self.kvstore
        return load_report(
            engine,
            self.loop.step_model if self.loop is not None else None,
            num_queued_prompt_tokens=self._facts.num_queued_prompt_tokens if self._facts else 0,
            num_active_leases=len(self.decode.leases) if self.decode is not None else 0,
            fetch_s_per_token=kvstore.fetch_s_per_token
            if kvstore is not None and kvstore.num_fetches
            else None,
        )

    def _register_request(self) -> registry_pb2.RegisterWorkerRequest:
        engine = self.engine
        if engine is None:
            raise FailedPrecondition("the worker is not serving")
        return registry_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id,
            role=ROLE_TO_PB[self.role],
            address=self.address,
            kv_events_endpoint=self.kv_events_endpoint,
            model=model_info_to_pb(engine.model_info),
            load=self._load_report(),
        )


def _queued_request_ids(engine: LLMEngine) -> list[str]:
    """On the engine thread: requests waiting to be scheduled, none of whose sequences runs."""
    sched = engine.scheduler
    running = {r.parent_id or r.request_id for r in sched.running}
    return sorted({r.parent_id or r.request_id for r in sched.waiting} - running)
