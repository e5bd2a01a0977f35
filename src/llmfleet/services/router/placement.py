"""Where a request's legs run: routing decisions, legs, retries, placement and migration.

    placement = Placement(config, registry, pool, kv, replies, policy, on_broken=worker_gone)
    worker_id = placement.route(run, "unified", run.prompt_ids)    # policy over live workers
    await placement.place(run, indices, prompt_ids, params)         # AddRequest, retrying
    await placement.migrate(run, worker_id, why)                    # what it held, elsewhere

A leg is one submission to one worker (request.py). Every failed attempt counts as one retry of
the request and excludes that worker from it; past `max_retries` the request fails with
UNAVAILABLE (RESOURCE_EXHAUSTED when the last worker was full). A worker whose channel is broken
is dropped from the fleet on the spot (`on_broken`), which migrates its other requests too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

import grpc

from llmfleet.services.router import metrics, spans
from llmfleet.services.router.pinning import Pins
from llmfleet.services.router.registry import ROLE_DECODE, ROLE_UNIFIED, WorkerRegistry
from llmfleet.services.router.replies import ReplyReceiver
from llmfleet.services.router.request import CompletionState, Leg, Outputs, RequestRun
from llmfleet.services.router.routed_load import RoutedLoad
from llmfleet.services.router.routing import (
    OUTCOME_PINNED,
    Candidate,
    Policy,
    RouteDecision,
    fetched_tokens,
    uncached_tokens,
)
from llmfleet.services.router.store_view import StoreView
from llmfleet.services.router.workers import WorkerPool
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.config import RouterConfig
from llmfleet.shared.core.errors import CapacityError, ValidationError
from llmfleet.shared.core.multimodal import mm_spans
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import images_to_pb, sampling_to_pb
from llmfleet.shared.wire.kv_subscriber import KVSubscriber
from llmfleet.shared.wire.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import dataplane_pb2, worker_pb2

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0
MAX_SESSIONS = 1 << 16  # sessions whose latest worker the router remembers (least recent go)
_ADD_TIMEOUT_S = 60.0
# Worker answers that say "this request is wrong" rather than "not here, try elsewhere".
FINAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED)


def field_error(details: str | None, default_field: str) -> ValidationError:
    """A ValidationError from an INVALID_ARGUMENT status whose details read `field: message`."""
    text = details or ""
    field, sep, message = text.partition(": ")
    if sep and field and " " not in field:
        return ValidationError(field, message)
    return ValidationError(default_field, text)


def mark_submitted(run: RequestRun) -> None:
    """The request left the router's queue (first successful submission)."""
    if run.submitted_at is None:
        run.submitted_at = time.perf_counter()
        metrics.QUEUE_TIME.labels(run.model.model_id).observe(run.submitted_at - run.arrival)
        NUM_REQUESTS_WAITING.labels(run.model.model_id).dec()
        NUM_REQUESTS_RUNNING.labels(run.model.model_id).inc()


class Placement:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        pool: WorkerPool,
        kv: KVSubscriber,
        replies: ReplyReceiver,
        policy: Policy,
        *,
        on_broken: Callable[[str, str], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.kv = kv
        self.replies = replies
        self.policy = policy
        self._on_broken = on_broken
        self.routed = RoutedLoad()  # legs placed, prompts not yet answered, per worker
        self.store: StoreView | None = None  # what the kvstore holds (server.py sets it)
        self._freed: dict[str, asyncio.Event] = {}  # worker id -> set when it frees KV
        # session id -> the worker its latest request was routed to (least recent first)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self.pins = Pins()  # request id -> the worker its call named (the servicer holds them)

    @property
    def serving_role(self) -> str:
        return ROLE_DECODE if self.config.mode == "disaggregated" else ROLE_UNIFIED

    def candidates(
        self, run: RequestRun, role: str, hashes: Sequence[bytes], use_prefix: bool
    ) -> list[Candidate]:
        return self._candidates(role, hashes, use_prefix, run.excluded, run.session_id)

    def _candidates(
        self,
        role: str,
        hashes: Sequence[bytes],
        use_prefix: bool,
        excluded: Collection[str],
        session_id: str,
    ) -> list[Candidate]:
        out = []
        store = self.store.matched_prefix(hashes) if use_prefix and self.store else 0
        session = self._sessions.get(session_id) if use_prefix and session_id else None
        for w in self.registry.live(role):
            if w.worker_id in excluded:
                continue
            prefix = self.kv.index.matched_prefix(w.worker_id, hashes) if use_prefix else 0
            out.append(
                self.routed.candidate(
                    w.worker_id,
                    w.load,
                    prefix_blocks=prefix,
                    store_blocks=store,
                    affinity=w.worker_id == session,
                )
            )
        return out

    def pick(
        self,
        role: str,
        hashes: Sequence[bytes],
        num_prompt_tokens: int,
        block_size: int,
        *,
        session_id: str = "",
        excluded: Collection[str] = (),
        pin: str = "",
        policy: Policy | None = None,
    ) -> tuple[RouteDecision, Candidate]:
        """The worker of `role` for a prompt of `num_prompt_tokens` tokens whose block hashes
        are `hashes` (read only when the policy counts prefixes), and what the policy saw of
        it: the worker `pin` names (registered address or id) when it is a candidate, else the
        policy's choice among the live workers not in `excluded`. Places nothing, records
        nothing: `route` does that for a request; the endpoint picker (epp.py) only asks."""
        policy = policy or self.policy
        cands = self._candidates(role, hashes, policy.needs_prefix, excluded, session_id)
        if not cands:
            raise Unavailable(f"no live {role} worker")
        pinned = next((c for c in cands if pin and self._names(c.worker_id, pin)), None)
        if pinned is not None:
            prefix = pinned.prefix_blocks * block_size
            return RouteDecision(policy.name, pinned.worker_id, prefix, OUTCOME_PINNED), pinned
        decision = policy.choose(cands, block_size, num_prompt_tokens)
        return decision, next(c for c in cands if c.worker_id == decision.worker_id)

    def _names(self, worker_id: str, pin: str) -> bool:
        """Whether `pin` names `worker_id`, a worker taking new requests."""
        info = self.registry.get(worker_id)
        return info is not None and not info.draining and pin in (info.address, worker_id)

    def route(
        self, run: RequestRun, role: str, prompt_ids: Sequence[int], policy: Policy | None = None
    ) -> str:
        """The worker of `role` for `prompt_ids` (one `route` span in the request's trace); the
        serving role's worker is the one the request's call named, if it can take it."""
        policy = policy or self.policy
        hashes: Sequence[bytes] = ()
        if policy.needs_prefix:
            hashes = run.block_hashes
            if len(prompt_ids) != len(run.prompt_ids):  # a continuation: its own chain
                ctx = HashContext(run.model.model_id, run.cache_salt)
                images = mm_spans(run.images)
                hashes = hash_block_chain(prompt_ids, run.model.block_size, ctx, images)
        with spans.tracer.start_as_current_span(
            "route", run.trace, attributes={"llmfleet.routing.role": role}
        ) as span:
            pin = self.pins.get(run.request_id) if role == self.serving_role else ""
            try:
                decision, pick = self.pick(
                    role,
                    hashes,
                    len(prompt_ids),
                    run.model.block_size,
                    session_id=run.session_id,
                    excluded=run.excluded,
                    pin=pin,
                    policy=policy,
                )
            except Unavailable:
                raise Unavailable(f"no live {role} worker for request {run.request_id}") from None
            spans.set_route(span, decision)
        metrics.ROUTING.labels(decision.policy, decision.outcome).inc()
        logger.debug(
            "request %s -> %s (%s, %s, prefix %d tokens)",
            run.request_id,
            decision.worker_id,
            decision.policy,
            decision.outcome,
            decision.matched_prefix_tokens,
        )
        if policy.needs_prefix:  # (a decode pick for a lease does not count prefixes)
            self._remember_session(run.session_id, decision.worker_id)
            bs, n = run.model.block_size, len(prompt_ids)
            run.routed_uncached_tokens = uncached_tokens(pick, bs, n)
            run.routed_fetched_tokens = fetched_tokens(pick, bs, n)
        if decision.predicted_ttft_s is not None and run.first_token_at is None:
            run.predicted_ttft = (decision.policy, time.perf_counter(), decision.predicted_ttft_s)
        return decision.worker_id

    def _remember_session(self, session_id: str, worker_id: str) -> None:
        if not session_id:
            return
        self._sessions[session_id] = worker_id
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def new_leg(
        self,
        run: RequestRun,
        worker_id: str,
        indices: tuple[int, ...],
        prefill_tokens: int = 0,
        fetch_tokens: int = 0,
    ) -> Leg:
        """A leg on `worker_id`, which is to compute `prefill_tokens` prompt tokens for it and
        fetch `fetch_tokens` (counted in that worker's queue for routing until the leg's first
        output)."""
        wire_id = run.next_wire_id()
        run.num_legs += 1
        run.used(worker_id)
        leg = Leg(wire_id, worker_id, indices)
        leg.prefill_tokens, leg.fetch_tokens = max(0, prefill_tokens), max(0, fetch_tokens)
        run.legs[wire_id] = leg
        self.routed.sent(worker_id, 1)
        if leg.prefill_tokens:
            self.routed.prefill(worker_id, leg.prefill_tokens, 1, leg.fetch_tokens)
        events = run.events

        def sink(from_worker: str, outs: Sequence[dataplane_pb2.SequenceOutput]) -> None:
            if leg.prefill_tokens:
                self._prefilled(leg)
            events.put_nowait(Outputs(leg, from_worker, outs, [time.perf_counter()]))

        self.replies.register(wire_id, sink)
        return leg

    def freed(self, worker_id: str) -> None:
        """`worker_id` has just released KV (a request ended there, or a lease): wake the
        requests waiting for its capacity."""
        event = self._freed.pop(worker_id, None)
        if event is not None:
            event.set()

    async def wait_for_capacity(self, worker_id: str, timeout_s: float) -> None:
        """Until `worker_id` frees KV, or `timeout_s` (it may free some that this router does
        not see: another router's request, an expired lease)."""
        event = self._freed.setdefault(worker_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def prediction_met(self, run: RequestRun, first_token_at: float) -> None:
        """The first token arrived: how far the routing policy's TTFT prediction was off."""
        if run.predicted_ttft is not None:
            policy, routed_at, predicted = run.predicted_ttft
            error = abs(first_token_at - routed_at - predicted)
            metrics.PREDICTION_ERROR.labels(policy).observe(error)

    def _prefilled(self, leg: Leg) -> None:
        """`leg`'s prompt left its worker's queue (first output, or the leg closed)."""
        self.routed.prefill(leg.worker_id, -leg.prefill_tokens, -1, -leg.fetch_tokens)
        leg.prefill_tokens = leg.fetch_tokens = 0

    def close_leg(self, run: RequestRun, leg: Leg) -> None:
        if leg.prefill_tokens:
            self._prefilled(leg)
        if run.legs.pop(leg.wire_id, None) is None:
            return
        self.freed(leg.worker_id)
        self.replies.unregister(leg.wire_id)
        self.routed.sent(leg.worker_id, -1)

    def retry(self, run: RequestRun, worker_id: str, why: str, code: grpc.StatusCode) -> None:
        """Count one retry after `worker_id` failed the request, or give up."""
        run.excluded.add(worker_id)
        if self.pool.is_broken(worker_id):
            self._on_broken(worker_id, why)
        run.num_retries += 1
        if run.num_retries > self.config.max_retries:
            retries = self.config.max_retries
            msg = f"request {run.request_id}: {why} (gave up after {retries} retries)"
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise CapacityError(msg)
            raise Unavailable(msg)
        logger.info("request %s: %s; retrying", run.request_id, why)

    async def place(
        self,
        run: RequestRun,
        indices: tuple[int, ...],
        prompt_ids: list[int],
        params: SamplingParams,
        replayed: int = 0,  # the last tokens of prompt_ids are the completion's streamed output
    ) -> None:
        """Run completions `indices` on one worker via AddRequest (retrying elsewhere)."""
        role = self.serving_role
        while True:
            worker_id = self.route(run, role, prompt_ids)
            stub = self.pool.stub(worker_id)
            # (at least its last token is computed, even with the whole prompt cached)
            uncached = run.routed_uncached_tokens or len(prompt_ids)
            leg = self.new_leg(run, worker_id, indices, uncached, run.routed_fetched_tokens)
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
                        num_replayed_tokens=replayed,
                        images=images_to_pb(run.images),
                    ),
                    timeout=_ADD_TIMEOUT_S,
                    metadata=metadata(run.trace),
                )
            except grpc.aio.AioRpcError as exc:
                self.close_leg(run, leg)
                if exc.code() in FINAL_CODES:
                    raise field_error(exc.details(), "prompt") from None
                why = f"worker {worker_id} AddRequest: {exc.code().name}: {exc.details()}"
                self.retry(run, worker_id, why, exc.code())
                continue
            except Unavailable as exc:
                self.close_leg(run, leg)
                self.retry(run, worker_id, str(exc), grpc.StatusCode.UNAVAILABLE)
                continue
            if run.num_legs == 1:
                run.num_cached_tokens = max(run.num_cached_tokens, resp.num_cached_tokens)
            mark_submitted(run)
            return

    async def migrate(self, run: RequestRun, worker_id: str, why: str) -> None:
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
            self.close_leg(run, leg)
        if not unfinished:
            return
        why = f"worker {worker_id} failed: {why}"
        self.retry(run, worker_id, why, grpc.StatusCode.UNAVAILABLE)
        metrics.MIGRATIONS.inc()
        try:
            if not any(c.token_ids for c in unfinished):
                params = dataclasses.replace(run.params, n=len(unfinished))
                await self.place(run, tuple(c.index for c in unfinished), run.prompt_ids, params)
                return
            for c in unfinished:
                ids, resumed = run.prompt_ids + c.token_ids, _continuation(run.params, c)
                await self.place(run, (c.index,), ids, resumed, replayed=len(c.token_ids))
        except Unavailable as exc:  # the client learns why its request had to move
            raise Unavailable(f"{why}; {exc}") from None


def _continuation(params: SamplingParams, c: CompletionState) -> SamplingParams:
    """Sampling for completion `c` resumed elsewhere after `len(c.token_ids)` streamed tokens."""
    done = len(c.token_ids)
    return dataclasses.replace(
        params,
        n=1,
        max_tokens=max(1, params.max_tokens - done),
        min_tokens=max(0, params.min_tokens - done),
        seed=None if params.seed is None else params.seed + c.index,
    )
