"""The scheduler's request orchestration: admission, routing, submission, streaming, migration.

    sched = Scheduler(config, ctx, tokenizer_stub)       # owns registry, KV index, reply endpoint
    async for response in sched.generate(request_pb):    # GenerateResponse messages
        ...

Per request (docs/fleet.md): validate → tokenize → check against the model → route → submit
(aggregated: `AddRequest`; disaggregated: `ReserveKV` → `Prefill` → first token → `StartDecode`)
→ per engine step: detokenize each completion's new tokens, stream a delta → last message with
usage. A worker failure (RPC error on a dead channel, lost connection, heartbeat timeout) while
it holds the request re-submits what it held (prompt + tokens already streamed) elsewhere, up to
`max_retries` times. Whatever way a request ends, `_finish` cancels what still runs on workers
and releases an open lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc
import zmq.asyncio

from llmfleet.services.scheduler import metrics
from llmfleet.services.scheduler.detok import DetokStream
from llmfleet.services.scheduler.kv_index import KVSnapshot
from llmfleet.services.scheduler.kv_subscriber import KVSubscriber
from llmfleet.services.scheduler.registry import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_UNIFIED,
    ModelSpec,
    WorkerRegistry,
)
from llmfleet.services.scheduler.replies import ReplyReceiver
from llmfleet.services.scheduler.request import (
    Aborted,
    Completion,
    Lease,
    Leg,
    RequestRun,
    WorkerFailed,
)
from llmfleet.services.scheduler.routing import Candidate, LeastLoad, Policy, make_policy
from llmfleet.services.scheduler.workers import WorkerPool
from llmfleet.services.worker.engine.sampling_params import SamplingLimits, SamplingParams
from llmfleet.shared.block_hash import HashContext, hash_block_chain
from llmfleet.shared.config import SchedulerConfig
from llmfleet.shared.convert import FINISH_FROM_PB, sampling_from_pb, sampling_to_pb
from llmfleet.shared.errors import CapacityError, ValidationError
from llmfleet.shared.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from llmfleet.shared.service import Unavailable
from llmfleet.v1 import (
    common_pb2,
    dataplane_pb2,
    generation_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
)

logger = logging.getLogger(__name__)

_STOP = common_pb2.FINISH_REASON_STOP
_LENGTH = common_pb2.FINISH_REASON_LENGTH
_ABORT = common_pb2.FINISH_REASON_ABORT
_CONTROL_TIMEOUT_S = 10.0
_ADD_TIMEOUT_S = 60.0
# Worker answers that say "not here, try elsewhere" rather than "this request is wrong".
_FINAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED)


def _field_error(details: str | None, default_field: str) -> ValidationError:
    """A ValidationError from an INVALID_ARGUMENT status whose details read `field: message`."""
    text = details or ""
    field, sep, message = text.partition(": ")
    if sep and field and " " not in field:
        return ValidationError(field, message)
    return ValidationError(default_field, text)


class Scheduler:
    """Owns the fleet's view (registry, channels, KV index) and every in-flight request."""

    def __init__(
        self,
        config: SchedulerConfig,
        ctx: zmq.asyncio.Context,
        tokenizer: tokenizer_pb2_grpc.TokenizerStub,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.registry = WorkerRegistry(config.heartbeat_timeout_ms)
        self.pool = WorkerPool(lambda wid: self.worker_gone(wid, "connection lost"))
        self.kv = KVSubscriber(ctx, self._fetch_snapshot)
        self.replies = ReplyReceiver(ctx, config.host)
        self.policy: Policy = make_policy(config.routing_policy, config.prefix_load_threshold)
        self._decode_policy = LeastLoad()
        self.runs: dict[str, RequestRun] = {}
        self._pending: dict[str, bool] = {}  # admitted, not yet a run: request id -> aborted
        self._inflight: dict[str, int] = {}  # worker id -> legs the scheduler placed there
        self._background: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.model_name = ""

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    @property
    def serving_roles(self) -> tuple[str, ...]:
        return (ROLE_DECODE,) if self.disaggregated else (ROLE_UNIFIED,)

    def start(self) -> None:
        self.replies.start()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.kv.close()
        await self.replies.close()
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
        return any(self.registry.live(role) for role in self.serving_roles)

    def model(self) -> ModelSpec | None:
        roles = (ROLE_PREFILL, ROLE_DECODE) if self.disaggregated else (ROLE_UNIFIED,)
        return self.registry.model(roles)

    async def _fetch_snapshot(self, worker_id: str) -> KVSnapshot:
        stub = self.pool.stub(worker_id)
        if stub is None:
            raise Unavailable(f"worker {worker_id} is not connected")
        resp = await stub.GetKVSnapshot(
            worker_pb2.GetKVSnapshotRequest(), timeout=_CONTROL_TIMEOUT_S
        )
        return KVSnapshot(worker_id, resp.seq, tuple(resp.block_hashes))

    # -- abort --------------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        run = self.runs.get(request_id)
        if run is not None:
            run.events.put_nowait(Aborted())
            return True
        if request_id in self._pending:
            self._pending[request_id] = True
            return True
        return False

    # -- Generate -----------------------------------------------------------------------------

    async def generate(
        self, req: generation_pb2.GenerateRequest
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self.runs or request_id in self._pending:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise ValidationError("prompt", "set exactly one of text, tokens or chat")
        params = sampling_from_pb(req.sampling)
        if kind == "text" and not req.text:
            raise ValidationError("text", "must not be empty")
        if kind == "tokens" and not req.tokens.token_ids:
            raise ValidationError("tokens.token_ids", "must not be empty")
        if self.draining:
            raise Unavailable("the scheduler is draining")
        model = self.model()
        if model is None or not self.usable():
            raise Unavailable("no live worker serves requests")
        if len(self.runs) + len(self._pending) >= self.config.max_queued_requests:
            raise CapacityError(
                f"{self.config.max_queued_requests} requests are queued or running; retry later"
            )
        label = model.model_id
        NUM_REQUESTS_WAITING.labels(label).inc()
        self._pending[request_id] = False
        run: RequestRun | None = None
        try:
            prompt_ids = await self._prompt_ids(req, kind, model)
            _check_sampling(params, model, len(prompt_ids))
            hashes: list[bytes] = []
            if self.policy.needs_prefix:
                ctx = HashContext(model.model_id, req.cache_salt)
                hashes = hash_block_chain(prompt_ids, model.block_size, ctx)
            completions = [Completion(i, DetokStream(self.tokenizer)) for i in range(params.n)]
            run = RequestRun(
                request_id, prompt_ids, params, req.cache_salt, model, hashes, completions
            )
            run.aborted = self._pending.pop(request_id)
            self.runs[request_id] = run
            await asyncio.gather(*(c.detok.open(prompt_ids, params) for c in completions))
            if run.aborted:
                run.events.put_nowait(Aborted())
            else:
                async for resp in self._submit(run):
                    yield resp
            while not run.done:
                resp = await self._on_event(run, await run.events.get())
                if resp is not None:
                    yield resp
        finally:
            self._pending.pop(request_id, None)
            if run is None or run.submitted_at is None:
                NUM_REQUESTS_WAITING.labels(label).dec()
            if run is not None:
                self._finish(run)

    async def _prompt_ids(
        self, req: generation_pb2.GenerateRequest, kind: str, model: ModelSpec
    ) -> list[int]:
        if kind == "tokens":
            ids = list(req.tokens.token_ids)
            for i, t in enumerate(ids):
                if not 0 <= t < model.vocab_size:
                    raise ValidationError(
                        "tokens.token_ids",
                        f"token id {t} at position {i} is outside the vocabulary "
                        f"[0, {model.vocab_size})",
                    )
            return ids
        tok_req = (
            tokenizer_pb2.TokenizeRequest(text=req.text)
            if kind == "text"
            else tokenizer_pb2.TokenizeRequest(chat=req.chat)
        )
        try:
            resp = await self.tokenizer.Tokenize(tok_req, timeout=_CONTROL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise _field_error(exc.details(), kind) from None
            raise Unavailable(f"tokenizer: {exc.code().name}: {exc.details()}") from None
        if not resp.token_ids:
            raise ValidationError(kind, "the prompt has no tokens")
        return list(resp.token_ids)

    # -- submission ---------------------------------------------------------------------------

    async def _submit(self, run: RequestRun) -> AsyncIterator[generation_pb2.GenerateResponse]:
        indices = tuple(range(run.params.n))
        lease_path = (
            self.disaggregated
            and run.params.n == 1
            and len(run.prompt_ids) >= self.config.short_prompt_threshold
        )
        if not lease_path:
            await self._place(run, indices, run.prompt_ids, run.params)
            return
        first = await self._prefill(run)
        if first is None:  # no prefill worker: the decode worker prefilled it itself
            return
        yield first
        if not run.done:
            await self._start_decode(run)

    def _mark_submitted(self, run: RequestRun) -> None:
        if run.submitted_at is None:
            run.submitted_at = time.perf_counter()
            metrics.QUEUE_TIME.labels(run.model.model_id).observe(run.submitted_at - run.arrival)
            NUM_REQUESTS_WAITING.labels(run.model.model_id).dec()
            NUM_REQUESTS_RUNNING.labels(run.model.model_id).inc()

    def _candidates(
        self, run: RequestRun, role: str, hashes: Sequence[bytes], use_prefix: bool
    ) -> list[Candidate]:
        out = []
        for w in self.registry.live(role):
            if w.worker_id in run.excluded:
                continue
            prefix = self.kv.index.matched_prefix(w.worker_id, hashes) if use_prefix else 0
            out.append(
                Candidate(
                    w.worker_id,
                    max(w.load.num_requests, self._inflight.get(w.worker_id, 0)),
                    w.load.num_free_blocks,
                    prefix,
                )
            )
        return out

    def _route(
        self, run: RequestRun, role: str, prompt_ids: Sequence[int], policy: Policy | None = None
    ) -> str:
        policy = policy or self.policy
        hashes: Sequence[bytes] = ()
        if policy.needs_prefix:
            hashes = run.block_hashes
            if len(prompt_ids) != len(run.prompt_ids):  # a continuation: its own chain
                ctx = HashContext(run.model.model_id, run.cache_salt)
                hashes = hash_block_chain(prompt_ids, run.model.block_size, ctx)
        cands = self._candidates(run, role, hashes, policy.needs_prefix)
        if not cands:
            raise Unavailable(f"no live {role} worker for request {run.request_id}")
        decision = policy.choose(cands, run.model.block_size)
        metrics.ROUTING.labels(decision.policy, decision.outcome).inc()
        logger.debug(
            "request %s -> %s (%s, %s, prefix %d tokens)",
            run.request_id,
            decision.worker_id,
            decision.policy,
            decision.outcome,
            decision.matched_prefix_tokens,
        )
        return decision.worker_id

    def _new_leg(self, run: RequestRun, worker_id: str, indices: tuple[int, ...]) -> Leg:
        wire_id = run.request_id if run.num_legs == 0 else f"{run.request_id}/{run.num_legs}"
        run.num_legs += 1
        leg = Leg(wire_id, worker_id, indices)
        run.legs[wire_id] = leg
        self._inflight[worker_id] = self._inflight.get(worker_id, 0) + 1
        events = run.events

        def sink(from_worker: str, outs: Sequence[dataplane_pb2.SequenceOutput]) -> None:
            events.put_nowait((leg, from_worker, outs))

        self.replies.register(wire_id, sink)
        return leg

    def _close_leg(self, run: RequestRun, leg: Leg) -> None:
        if run.legs.pop(leg.wire_id, None) is None:
            return
        self.replies.unregister(leg.wire_id)
        n = self._inflight.get(leg.worker_id, 0) - 1
        if n > 0:
            self._inflight[leg.worker_id] = n
        else:
            self._inflight.pop(leg.worker_id, None)

    def _retry(self, run: RequestRun, worker_id: str, why: str, code: grpc.StatusCode) -> None:
        """Count one retry after `worker_id` failed the request, or give up."""
        run.excluded.add(worker_id)
        if self.pool.is_broken(worker_id):
            self.worker_gone(worker_id, why)
        run.num_retries += 1
        if run.num_retries > self.config.max_retries:
            retries = self.config.max_retries
            msg = f"request {run.request_id}: {why} (gave up after {retries} retries)"
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise CapacityError(msg)
            raise Unavailable(msg)
        logger.info("request %s: %s; retrying", run.request_id, why)

    async def _place(
        self,
        run: RequestRun,
        indices: tuple[int, ...],
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Run completions `indices` on one worker via AddRequest (retrying elsewhere)."""
        role = ROLE_DECODE if self.disaggregated else ROLE_UNIFIED
        while True:
            worker_id = self._route(run, role, prompt_ids)
            stub = self.pool.stub(worker_id)
            leg = self._new_leg(run, worker_id, indices)
            try:
                if stub is None:
                    raise Unavailable(f"worker {worker_id} is not connected")
                resp = await stub.AddRequest(
                    worker_pb2.AddRequestRequest(
                        request_id=leg.wire_id,
                        prompt_token_ids=prompt_ids,
                        sampling=sampling_to_pb(params),
                        cache_salt=run.cache_salt,
                        reply_endpoint=self.replies.endpoint,
                    ),
                    timeout=_ADD_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                self._close_leg(run, leg)
                if exc.code() in _FINAL_CODES:
                    raise _field_error(exc.details(), "prompt") from None
                why = f"worker {worker_id} AddRequest: {exc.code().name}: {exc.details()}"
                self._retry(run, worker_id, why, exc.code())
                continue
            except Unavailable as exc:
                self._close_leg(run, leg)
                self._retry(run, worker_id, str(exc), grpc.StatusCode.UNAVAILABLE)
                continue
            if run.num_legs == 1:
                run.num_cached_tokens = max(run.num_cached_tokens, resp.num_cached_tokens)
            self._mark_submitted(run)
            return

    async def _prefill(self, run: RequestRun) -> generation_pb2.GenerateResponse | None:
        """Lease handoff up to the first token; None when it fell back to the decode worker."""
        while True:
            decode_id = self._route(run, ROLE_DECODE, run.prompt_ids, self._decode_policy)
            if not self._candidates(run, ROLE_PREFILL, (), False):
                await self._place(run, (0,), run.prompt_ids, run.params)
                return None
            prefill_id = self._route(run, ROLE_PREFILL, run.prompt_ids)
            d_stub, p_stub = self.pool.stub(decode_id), self.pool.stub(prefill_id)
            if d_stub is None or p_stub is None:
                missing = decode_id if d_stub is None else prefill_id
                why = f"worker {missing} not connected"
                self._retry(run, missing, why, grpc.StatusCode.UNAVAILABLE)
                continue
            wire_id = run.request_id if run.num_legs == 0 else f"{run.request_id}/{run.num_legs}"
            try:
                reserved = await d_stub.ReserveKV(
                    worker_pb2.ReserveKVRequest(
                        request_id=wire_id,
                        num_prompt_tokens=len(run.prompt_ids),
                        ttl_ms=self.config.lease_ttl_ms,
                    ),
                    timeout=_CONTROL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                metrics.LEASES.labels("reserve_failed").inc()
                why = f"decode worker {decode_id} ReserveKV: {exc.code().name}: {exc.details()}"
                self._retry(run, decode_id, why, exc.code())
                continue
            pb_lease = reserved.lease
            run.lease = Lease(
                pb_lease.lease_id,
                pb_lease.epoch,
                decode_id,
                pb_lease.kv_endpoint,
                pb_lease.expires_at_unix_ms,
                pb_lease.num_blocks,
            )
            try:
                pre = await p_stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=wire_id,
                        prompt_token_ids=run.prompt_ids,
                        sampling=sampling_to_pb(run.params),
                        cache_salt=run.cache_salt,
                        lease=pb_lease,
                    ),
                    timeout=self.config.lease_ttl_ms / 1000.0 + _CONTROL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                await self._release_lease_now(run, "released")
                if exc.code() in _FINAL_CODES:
                    raise _field_error(exc.details(), "prompt") from None
                why = f"prefill worker {prefill_id} Prefill: {exc.code().name}: {exc.details()}"
                self._retry(run, prefill_id, why, exc.code())
                continue
            run.num_cached_tokens = max(run.num_cached_tokens, pre.num_cached_tokens)
            self._mark_submitted(run)
            leg = self._new_leg(run, decode_id, (0,))
            out = dataplane_pb2.SequenceOutput(
                request_id=leg.wire_id, index=0, token_ids=[pre.first_token_id]
            )
            if run.params.logprobs is not None and pre.HasField("first_logprobs"):
                out.logprobs.append(pre.first_logprobs)
            if pre.finished:
                out.finish_reason = _first_token_finish(run.params, pre.first_token_id, out)
            resp = await self._apply_outputs(run, leg, (out,))
            if run.done:
                self._release_lease(run, "released")
            return resp

    async def _start_decode(self, run: RequestRun) -> None:
        lease = run.lease
        leg = next(iter(run.legs.values()), None)
        if lease is None or leg is None:
            return
        stub = self.pool.stub(lease.decode_worker_id)
        first = run.completions[0].token_ids[0]
        try:
            if stub is None:
                raise Unavailable(f"decode worker {lease.decode_worker_id} is not connected")
            await stub.StartDecode(
                worker_pb2.StartDecodeRequest(
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    request_id=leg.wire_id,
                    prompt_token_ids=run.prompt_ids,
                    first_token_id=first,
                    sampling=sampling_to_pb(run.params),
                    cache_salt=run.cache_salt,
                    reply_endpoint=self.replies.endpoint,
                ),
                timeout=_CONTROL_TIMEOUT_S,
            )
        except (grpc.aio.AioRpcError, Unavailable) as exc:
            expired = (
                isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() is grpc.StatusCode.FAILED_PRECONDITION
            )
            await self._release_lease_now(run, "expired" if expired else "failed")
            await self._migrate(run, lease.decode_worker_id, f"StartDecode failed: {exc}")
            return
        run.lease = None
        metrics.LEASES.labels("committed").inc()

    def _release_lease(self, run: RequestRun, outcome: str) -> None:
        lease, run.lease = run.lease, None
        if lease is None:
            return
        metrics.LEASES.labels(outcome).inc()
        stub = self.pool.stub(lease.decode_worker_id)
        if stub is not None:
            self._spawn(
                stub.ReleaseKV(
                    worker_pb2.ReleaseKVRequest(lease_id=lease.lease_id, epoch=lease.epoch),
                    timeout=_CONTROL_TIMEOUT_S,
                )
            )

    async def _release_lease_now(self, run: RequestRun, outcome: str) -> None:
        """Release the open lease before retrying, so a retry never holds two reservations."""
        lease, run.lease = run.lease, None
        if lease is None:
            return
        metrics.LEASES.labels(outcome).inc()
        stub = self.pool.stub(lease.decode_worker_id)
        if stub is None:
            return
        try:
            await stub.ReleaseKV(
                worker_pb2.ReleaseKVRequest(lease_id=lease.lease_id, epoch=lease.epoch),
                timeout=_CONTROL_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:  # the lease then expires on the worker by itself
            logger.info("ReleaseKV on %s failed: %s", lease.decode_worker_id, exc.code().name)

    async def _migrate(self, run: RequestRun, worker_id: str, why: str) -> None:
        """Re-submit what `worker_id` held: prompt + each completion's streamed tokens."""
        if run.lease is not None and run.lease.decode_worker_id == worker_id:
            run.lease = None
            metrics.LEASES.labels("lost").inc()
        legs = [leg for leg in run.legs.values() if leg.worker_id == worker_id]
        unfinished = [
            run.completions[i]
            for leg in legs
            for i in leg.indices
            if not run.completions[i].finished
        ]
        for leg in legs:
            self._close_leg(run, leg)
        if not unfinished:
            return
        why = f"worker {worker_id} failed: {why}"
        self._retry(run, worker_id, why, grpc.StatusCode.UNAVAILABLE)
        metrics.MIGRATIONS.inc()
        if not any(c.token_ids for c in unfinished):
            params = dataclasses.replace(run.params, n=len(unfinished))
            await self._place(run, tuple(c.index for c in unfinished), run.prompt_ids, params)
            return
        for c in unfinished:
            await self._place(
                run, (c.index,), run.prompt_ids + c.token_ids, _continuation(run.params, c)
            )

    # -- streaming ----------------------------------------------------------------------------

    async def _on_event(
        self, run: RequestRun, ev: object
    ) -> generation_pb2.GenerateResponse | None:
        if isinstance(ev, tuple):
            leg, worker_id, outs = ev
            if leg.wire_id not in run.legs or worker_id != leg.worker_id:
                return None
            return await self._apply_outputs(run, leg, outs)
        if isinstance(ev, WorkerFailed):
            if ev.worker_id in run.worker_ids():
                await self._migrate(run, ev.worker_id, ev.reason)
            return None
        if isinstance(ev, Aborted):
            resp = generation_pb2.GenerateResponse(request_id=run.request_id)
            for c in run.completions:
                if not c.finished:
                    c.finished, c.finish_reason = True, "abort"
                    resp.deltas.add(index=c.index, finish_reason=_ABORT)
            resp.usage.CopyFrom(self._usage(run))
            return resp
        return None

    async def _apply_outputs(
        self, run: RequestRun, leg: Leg, outs: Sequence[dataplane_pb2.SequenceOutput]
    ) -> generation_pb2.GenerateResponse | None:
        resp = generation_pb2.GenerateResponse(request_id=run.request_id)
        num_tokens = 0
        for out in outs:
            wire_index = out.index
            if not 0 <= wire_index < len(leg.indices):
                continue
            c = run.completions[leg.indices[wire_index]]
            if c.finished:
                continue
            ids = out.token_ids
            finished = out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            text, stop = await c.detok.feed(ids, finished)
            delta = resp.deltas.add(index=c.index, text=text, token_ids=ids)
            if out.logprobs:
                delta.logprobs.extend(out.logprobs)
            c.token_ids.extend(ids)
            num_tokens += len(ids)
            if out.num_cached_tokens and run.num_retries == 0:
                run.num_cached_tokens = max(run.num_cached_tokens, out.num_cached_tokens)
            if stop:
                c.finished, c.finish_reason = True, "stop"
                delta.finish_reason, delta.stop_string = _STOP, stop
                if not finished:
                    self._cancel(leg, wire_index, _STOP, stop)
                leg.open_indices.discard(wire_index)
            elif finished:
                c.finished = True
                c.finish_reason = FINISH_FROM_PB.get(out.finish_reason, "abort")
                delta.finish_reason = out.finish_reason
                if out.HasField("stop_token_id"):
                    delta.stop_token_id = out.stop_token_id
                leg.open_indices.discard(wire_index)
        if not leg.open_indices:
            self._close_leg(run, leg)
        if not resp.deltas:
            return None
        if num_tokens:
            now = time.perf_counter()
            if run.first_token_at is None:
                run.first_token_at = now
                metrics.TTFT.labels(run.model.model_id).observe(now - run.arrival)
            elif run.last_token_at is not None:
                metrics.ITL.labels(run.model.model_id).observe(now - run.last_token_at)
            run.last_token_at = now
        if run.done:
            resp.usage.CopyFrom(self._usage(run))
        return resp

    def _usage(self, run: RequestRun) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(run.prompt_ids),
            completion_tokens=run.num_completion_tokens(),
            cached_prompt_tokens=min(run.num_cached_tokens, len(run.prompt_ids)),
        )

    # -- ending -------------------------------------------------------------------------------

    def _finish(self, run: RequestRun) -> None:
        """Cancel whatever still runs for `run` on workers, release its lease, drop its state."""
        for leg in list(run.legs.values()):
            if leg.open_indices:
                self._cancel(leg, None, _ABORT, "")
            self._close_leg(run, leg)
        self._release_lease(run, "released")
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

    def _cancel(self, leg: Leg, wire_index: int | None, reason: int, stop_string: str) -> None:
        stub = self.pool.stub(leg.worker_id)
        if stub is None:
            return
        req = worker_pb2.CancelRequest(
            request_id=leg.wire_id, reason=reason, stop_string=stop_string
        )
        if wire_index is not None:
            req.index = wire_index
        self._spawn(stub.Cancel(req, timeout=_CONTROL_TIMEOUT_S))

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


def _check_sampling(params: SamplingParams, model: ModelSpec, num_prompt_tokens: int) -> None:
    limits = SamplingLimits(max_n=model.max_n, max_logprobs=model.max_logprobs)
    try:
        params.check_against(
            limits, num_prompt_tokens=num_prompt_tokens, max_model_len=model.max_model_len
        )
    except ValidationError as exc:
        raise ValidationError(f"sampling.{exc.field}", exc.message) from None


def _continuation(params: SamplingParams, c: Completion) -> SamplingParams:
    """Sampling for completion `c` resumed elsewhere after `len(c.token_ids)` streamed tokens."""
    done = len(c.token_ids)
    return dataclasses.replace(
        params,
        n=1,
        max_tokens=max(1, params.max_tokens - done),
        min_tokens=max(0, params.min_tokens - done),
        seed=None if params.seed is None else params.seed + c.index,
    )


def _first_token_finish(
    params: SamplingParams, token_id: int, out: dataplane_pb2.SequenceOutput
) -> int:
    """Why a prefill's first token already ended the sequence."""
    if params.max_tokens == 1:
        return _LENGTH
    if token_id in params.stop_token_ids:
        out.stop_token_id = token_id
    return _STOP
