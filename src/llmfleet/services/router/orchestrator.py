"""The router's request orchestration: admission, routing, submission, streaming, migration.

    router = Router(config, ctx, tokenizer_stub)       # owns registry, KV index, reply endpoint
    async for response in router.generate(request_pb):    # GenerateResponse messages

Per request (docs/fleet.md): validate → tokenize → check against the model → route → submit
(aggregated: `AddRequest`; disaggregated: `ReserveKV` → `Prefill` → first token → `StartDecode`)
→ per engine step: detokenize each completion's new tokens, stream a delta → last message with
usage. A worker failure (RPC error on a dead channel, lost connection, heartbeat timeout) while
it holds the request re-submits what it held (prompt + tokens already streamed) elsewhere, up to
`max_retries` times. Whatever way a request ends, `_finish` cancels what still runs on workers
and releases an open lease.

Routing, legs, retries and migration: placement.py; the lease handoff: handoff.py; here, the
request's life and its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import zmq.asyncio
from opentelemetry.context import Context

from llmfleet.services.router import metrics, spans
from llmfleet.services.router.detok import Detokenizer, DetokSequence
from llmfleet.services.router.handoff import LeaseHandoff
from llmfleet.services.router.placement import CONTROL_TIMEOUT_S, Placement
from llmfleet.services.router.prompt import check_sampling, check_shape, prompt_token_ids
from llmfleet.services.router.registry import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_UNIFIED,
    WorkerRegistry,
)
from llmfleet.services.router.replies import ReplyReceiver
from llmfleet.services.router.request import (
    Aborted,
    CompletionState,
    Leg,
    Outputs,
    RequestRun,
    WorkerFailed,
)
from llmfleet.services.router.routing import Policy, make_policy
from llmfleet.services.router.workers import WorkerPool
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.config import RouterConfig
from llmfleet.shared.core.errors import CapacityError, LLMFleetError, ValidationError
from llmfleet.shared.core.kv_index import KVSnapshot
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import mm_spans
from llmfleet.shared.wire.convert import FINISH_FROM_PB
from llmfleet.shared.wire.kv_subscriber import KVSubscriber
from llmfleet.shared.wire.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tls import FleetTLS
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import common_pb2, generation_pb2, tokenizer_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

_STOP = common_pb2.FINISH_REASON_STOP
_ABORT = common_pb2.FINISH_REASON_ABORT


class Router:
    """Owns the fleet's view (registry, channels, KV index) and every in-flight request."""

    def __init__(
        self,
        config: RouterConfig,
        ctx: zmq.asyncio.Context,
        tokenizer: tokenizer_pb2_grpc.TokenizerStub,
        tls: FleetTLS | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.registry = WorkerRegistry(config.heartbeat_timeout_ms)
        self.pool = WorkerPool(lambda wid: self.worker_gone(wid, "connection lost"), tls)
        self.kv = KVSubscriber(ctx, self._fetch_snapshot)
        self.replies = ReplyReceiver(
            ctx, config.internal_host, self.registry.touch, config.advertise_host
        )
        self.policy: Policy = make_policy(config.routing_policy, config.prefix_load_threshold)
        self.placement = Placement(
            config,
            self.registry,
            self.pool,
            self.kv,
            self.replies,
            self.policy,
            on_broken=self.worker_gone,
        )
        self.handoff = LeaseHandoff(config, self.placement, self.replies.endpoint, self._spawn)
        self.runs: dict[str, RequestRun] = {}
        self._pending: dict[str, bool] = {}  # admitted, not yet a run: request id -> aborted
        self._background: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.model_name = ""

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    def start(self) -> None:
        self.replies.start()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.kv.close()
        await self.replies.close()
        await self.detokenizer.close_stream()
        await self.pool.close()

    # -- fleet membership -----------------------------------------------------------------

    def on_registered(self, worker_id: str, address_changed: bool, events: str | None) -> None:
        """Connect to a (re-)registered worker; `events`: its KV-event endpoint to (re)subscribe."""
        info = self.registry.get(worker_id)
        if info is None:
            return
        if address_changed:
            self.pool.disconnect(worker_id)
        self.pool.connect(worker_id, info.address)
        if events is not None:
            self.kv.subscribe(worker_id, events)
        if not self.model_name:
            self.model_name = info.model.model_id

    def worker_gone(self, worker_id: str, reason: str) -> None:
        """Forget a worker (its next heartbeat answers known=False) and migrate its requests."""
        if self.registry.remove(worker_id) is None:
            return
        logger.warning("worker %s removed: %s", worker_id, reason)
        self.pool.disconnect(worker_id)
        self.kv.unsubscribe(worker_id)
        for run in self.runs.values():
            if worker_id in run.worker_ids():
                run.events.put_nowait(WorkerFailed(worker_id, reason))

    def sweep(self) -> None:
        """Drop workers whose heartbeats stopped."""
        for info in self.registry.expired():
            self.worker_gone(info.worker_id, "heartbeat timeout")

    def usable(self) -> bool:
        return bool(self.registry.live(self.placement.serving_role))

    def model(self) -> ModelInfo | None:
        roles = (ROLE_PREFILL, ROLE_DECODE) if self.disaggregated else (ROLE_UNIFIED,)
        return self.registry.model(roles)

    async def _fetch_snapshot(self, worker_id: str) -> KVSnapshot:
        stub = self.pool.stub(worker_id)
        if stub is None:
            raise Unavailable(f"worker {worker_id} is not connected")
        resp = await stub.GetKVSnapshot(
            worker_pb2.GetKVSnapshotRequest(), timeout=CONTROL_TIMEOUT_S
        )
        return KVSnapshot(worker_id, resp.seq, tuple(resp.block_hashes), epoch=resp.epoch)

    # -- abort --------------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        run = self.runs.get(request_id)
        if run is not None:
            run.aborted = True  # seen by a submission still waiting for capacity
            run.events.put_nowait(Aborted())
            return True
        if request_id in self._pending:
            self._pending[request_id] = True
            return True
        return False

    # -- Generate -----------------------------------------------------------------------------

    async def generate(
        self, req: generation_pb2.GenerateRequest, parent: Context | None = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One Generate call; `parent`: the caller's trace context (from its metadata), if any.
        The call is one `llm_request` span, ended (with usage or the error) however it ends."""
        request_id = req.request_id or uuid.uuid4().hex
        span, trace_ctx = spans.start_request(request_id, parent)
        run: RequestRun | None = None
        error: LLMFleetError | None = None
        try:
            if request_id in self.runs or request_id in self._pending:
                raise ValidationError("request_id", f"{request_id!r} is already running")
            kind, params = check_shape(req)
            if self.draining:
                raise Unavailable("the router is draining")
            model = self.model()
            if model is None or not self.usable():
                raise Unavailable("no live worker serves requests")
            if len(self.runs) + len(self._pending) >= self.config.max_queued_requests:
                raise CapacityError(
                    f"{self.config.max_queued_requests} requests are queued or running; retry later"
                )
            spans.set_request(span, kind, params, model.model_id)
            label = model.model_id
            NUM_REQUESTS_WAITING.labels(label).inc()
            self._pending[request_id] = False
            try:
                prompt = await prompt_token_ids(self.tokenizer, req, kind, model, trace_ctx)
                prompt_ids, images = prompt
                check_sampling(params, model, len(prompt_ids))
                hashes: list[bytes] = []
                if self.policy.needs_prefix:
                    ctx = HashContext(model.model_id, req.cache_salt)
                    hashes = hash_block_chain(prompt_ids, model.block_size, ctx, mm_spans(images))
                completions = [
                    CompletionState(i, DetokSequence(self.detokenizer, trace_ctx, i))
                    for i in range(params.n)
                ]
                run = RequestRun(
                    request_id, prompt_ids, params, req.cache_salt, model, hashes, completions
                )
                run.trace, run.session_id, run.images = trace_ctx, req.session_id, images
                run.aborted = self._pending.pop(request_id)
                self.runs[request_id] = run
                for c in completions:
                    c.detok.open(prompt_ids, params)
                if run.aborted:
                    run.events.put_nowait(Aborted())
                else:
                    async for resp in self._submit(run):
                        yield resp
                while not run.done:
                    resp = await self._on_event(run, await run.next_event())
                    if resp is not None:
                        yield resp
            finally:
                self._pending.pop(request_id, None)
                if run is None or run.submitted_at is None:
                    NUM_REQUESTS_WAITING.labels(label).dec()
                if run is not None:
                    self._finish(run)
        except LLMFleetError as exc:
            error = exc
            raise
        finally:
            spans.end_request(span, run, error)

    # -- submission ---------------------------------------------------------------------------

    async def _submit(self, run: RequestRun) -> AsyncIterator[generation_pb2.GenerateResponse]:
        indices = tuple(range(run.params.n))
        lease_path = (
            self.disaggregated
            and run.params.n == 1
            and len(run.prompt_ids) >= self.config.short_prompt_threshold
        )
        if not lease_path:
            await self.placement.place(run, indices, run.prompt_ids, run.params)
            return
        first = await self.handoff.prefill(run)
        if first is None:  # no prefill worker: the decode worker prefilled it itself
            return
        leg, out = first
        resp = await self._apply_outputs(
            run, Outputs(leg, leg.worker_id, (out,), [time.perf_counter()])
        )
        if run.done:
            self.handoff.release(run, "released")
        if resp is None:
            return
        yield resp
        if not run.done:
            await self.handoff.start_decode(run)

    # -- streaming ----------------------------------------------------------------------------

    async def _on_event(
        self, run: RequestRun, ev: object
    ) -> generation_pb2.GenerateResponse | None:
        if isinstance(ev, Outputs):
            if ev.leg.wire_id not in run.legs or ev.worker_id != ev.leg.worker_id:
                return None
            return await self._apply_outputs(run, ev)
        if isinstance(ev, WorkerFailed):
            if ev.worker_id in run.worker_ids():
                await self.placement.migrate(run, ev.worker_id, ev.reason)
            return None
        if isinstance(ev, Aborted):
            resp = generation_pb2.GenerateResponse(request_id=run.request_id)
            for c in run.completions:
                if not c.finished:
                    c.finished, c.finish_reason = True, "abort"
                    resp.deltas.add(index=c.index, finish_reason=_ABORT)
            resp.usage.CopyFrom(run.usage())
            return resp
        return None

    async def _apply_outputs(
        self, run: RequestRun, ev: Outputs
    ) -> generation_pb2.GenerateResponse | None:
        leg, outs = ev.leg, ev.outs
        resp = generation_pb2.GenerateResponse(request_id=run.request_id)
        num_tokens = 0
        for out in outs:
            wire_index = out.index
            if not 0 <= wire_index < len(leg.indices):
                continue
            c = run.completions[leg.indices[wire_index]]
            if c.finished:
                continue
            finished = out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            text, stop, used = await c.detok.feed(out.token_ids, finished)
            ids = out.token_ids[:used]  # a stop string ends the completion at its token
            delta = resp.deltas.add(index=c.index, text=text, token_ids=ids)
            if out.logprobs:
                delta.logprobs.extend(out.logprobs[:used])
            c.token_ids.extend(ids)
            c.count_drafts(out)
            num_tokens += len(ids)
            if out.num_cached_tokens and run.num_retries == 0:
                run.num_cached_tokens = max(run.num_cached_tokens, out.num_cached_tokens)
            if stop:
                c.finished, c.finish_reason = True, "stop"
                delta.finish_reason, delta.stop_string = _STOP, stop
                if not finished:
                    self._cancel(run, leg, wire_index, _STOP, stop)
                leg.open_indices.discard(wire_index)
            elif finished:
                c.finished = True
                c.finish_reason = FINISH_FROM_PB.get(out.finish_reason, "abort")
                delta.finish_reason = out.finish_reason
                if out.HasField("stop_token_id"):
                    delta.stop_token_id = out.stop_token_id
                leg.open_indices.discard(wire_index)
        if not leg.open_indices:
            self.placement.close_leg(run, leg)
        if not resp.deltas:
            return None
        if num_tokens:  # per step that gave tokens, as they reached the router
            for now in ev.arrived:
                if run.first_token_at is None:
                    run.first_token_at = now
                    metrics.TTFT.labels(run.model.model_id).observe(now - run.arrival)
                    self.placement.prediction_met(run, now)
                elif run.last_token_at is not None:
                    metrics.itl(run.model.model_id).observe(now - run.last_token_at)
                run.last_token_at = now
        if run.done:
            resp.usage.CopyFrom(run.usage())
        return resp

    # -- ending -------------------------------------------------------------------------------

    def _finish(self, run: RequestRun) -> None:
        """Cancel whatever still runs for `run` on workers, release its lease, drop its state."""
        for leg in list(run.legs.values()):
            if leg.open_indices:
                self._cancel(run, leg, None, _ABORT, "")
            self.placement.close_leg(run, leg)
        self.handoff.release(run, "released")
        for c in run.completions:
            c.detok.close()
        self.runs.pop(run.request_id, None)
        label = run.model.model_id
        if run.submitted_at is not None:
            NUM_REQUESTS_RUNNING.labels(label).dec()
        if run.done:
            reason = run.completions[0].finish_reason or "abort"
            metrics.REQUEST_SUCCESS.labels(label, reason).inc()
            metrics.E2E.labels(label).observe(time.perf_counter() - run.arrival)

    def _cancel(
        self, run: RequestRun, leg: Leg, wire_index: int | None, reason: int, stop_string: str
    ) -> None:
        stub = self.pool.stub(leg.worker_id)
        if stub is None:
            return
        req = worker_pb2.CancelRequest(request_id=leg.wire_id, reason=reason, index=wire_index)
        req.stop_string = stop_string
        self._spawn(stub.Cancel(req, timeout=CONTROL_TIMEOUT_S, metadata=metadata(run.trace)))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire-and-forget control RPCs (Cancel, ReleaseKV): they must outlive a cancelled
        handler, and their failure only matters to the worker (which frees on its own)."""

        async def run() -> None:
            try:
                await coro
            except grpc.aio.AioRpcError as exc:
                logger.debug("control RPC failed: %s", exc.code().name)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
