"""The disaggregated handoff, router side: lease on D, prefill on P, first token, decode on D.

    first = await handoff.prefill(run)      # (leg, first token output), or None: D prefills
    ... the orchestrator streams the first token ...
    await handoff.start_decode(run)         # D decodes; on failure the request migrates
    handoff.release(run, "released")        # whatever way the request ends

Sequence (docs/fleet.md): pick decode D (least load) and prefill P (the routing policy);
`D.ReserveKV` returns a lease; `P.Prefill(lease)` prefills, pushes the KV to D and answers the
first token; `D.StartDecode(lease)` starts decoding. A failure before StartDecode releases the
lease before the retry, so a request never holds two reservations; every release is counted by
outcome in `llmfleet:lease_outcomes`. Without a healthy prefill worker the decode worker takes
the whole request (it prefills itself).

Back-pressure: at most `max_prefills_per_worker` handoffs run per prefill worker (the others
wait for a slot before reserving anything), and a decode worker without KV for the prompt
(ReserveKV: RESOURCE_EXHAUSTED) is waited for, not failed: the request holds no lease and no
slot while it waits, and tries again once that worker frees KV. So a full decode worker slows
admission down instead of failing requests or filling with leases that expire in a queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from llmfleet.services.router import metrics, spans
from llmfleet.services.router.placement import (
    CONTROL_TIMEOUT_S,
    FINAL_CODES,
    Placement,
    field_error,
    mark_submitted,
)
from llmfleet.services.router.registry import ROLE_DECODE, ROLE_PREFILL
from llmfleet.services.router.request import Lease, Leg, RequestRun
from llmfleet.services.router.routing import DecodeHeadroom, LeastLoad, Policy, PredictedTTFT
from llmfleet.shared.core.config import RouterConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import images_to_pb, sampling_to_pb
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tracing import Metadata, metadata
from llmfleet.v1 import common_pb2, dataplane_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# A request waiting for a full decode worker looks again when the worker frees KV that this
# router sees end, and at least this often (it may free some this router does not see).
_CAPACITY_POLL_S = 0.5

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


class _DecodeFull(Exception):
    """The decode worker has no KV for the prompt now (ReserveKV: RESOURCE_EXHAUSTED)."""


class _AttemptFailed(Exception):
    """A handoff attempt failed on `worker_id` in a way another worker may not."""

    def __init__(self, worker_id: str, why: str, code: grpc.StatusCode) -> None:
        super().__init__(why)
        self.worker_id, self.why, self.code = worker_id, why, code


def _end_lease_span(
    span: Span, lease: Lease | None, pre: worker_pb2.PrefillResponse | None, error: str | None
) -> None:
    """The `kv_lease` span of one attempt: what moved and how long it took, or why it failed."""
    if span.is_recording():
        if lease is not None:
            span.set_attributes(
                {
                    "llmfleet.lease.id": lease.lease_id,
                    "llmfleet.lease.epoch": lease.epoch,
                    "llmfleet.lease.num_blocks": lease.num_blocks,
                }
            )
        if pre is not None:
            span.set_attributes(
                {
                    "llmfleet.kv.bytes": pre.kv_bytes,
                    "llmfleet.kv.transfer_s": pre.kv_transfer_us / 1e6,
                    "llmfleet.usage.cached_tokens": pre.num_cached_tokens,
                }
            )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
    span.end()


class LeaseHandoff:
    def __init__(
        self,
        config: RouterConfig,
        placement: Placement,
        reply_endpoint: str,
        spawn: Spawn,
    ) -> None:
        self.config = config
        self.placement = placement
        self.pool = placement.pool
        self._reply_endpoint = reply_endpoint
        self._spawn = spawn  # fire-and-forget control RPCs
        # With the predicting policy for prefills, decode workers are scored alike.
        predicting = config.routing_policy == PredictedTTFT.name
        self._decode_policy: Policy = DecodeHeadroom() if predicting else LeastLoad()
        self._prefill_slots: dict[str, asyncio.Semaphore] = {}

    async def prefill(self, run: RequestRun) -> tuple[Leg, dataplane_pb2.SequenceOutput] | None:
        """Lease handoff up to the first token; None when it fell back to the decode worker
        (or the request was aborted while it waited for capacity)."""
        placement = self.placement
        while True:
            if not placement.candidates(run, ROLE_PREFILL, (), False):
                await placement.place(run, (0,), run.prompt_ids, run.params)
                return None
            prefill_id = placement.route(run, ROLE_PREFILL, run.prompt_ids)
            full: str | None = None
            # In the prefill worker's queue for routing from here, its wait for a slot included.
            uncached = run.routed_uncached_tokens or len(run.prompt_ids)
            fetched = run.routed_fetched_tokens
            with placement.routed.in_prefill(prefill_id, uncached, fetched):
                async with self._slot(prefill_id):
                    if run.aborted:
                        return None
                    decode_id = placement.route(
                        run, ROLE_DECODE, run.prompt_ids, self._decode_policy
                    )
                    try:
                        with placement.routed.in_transfer(decode_id, len(run.prompt_ids)):
                            pre = await self._attempt(run, decode_id, prefill_id)
                    except _DecodeFull:
                        full = decode_id
                    except _AttemptFailed as failed:
                        placement.retry(run, failed.worker_id, failed.why, failed.code)
                        continue
            if full is not None:
                # Back-pressure, not failure: the request waits in the router until the
                # decode worker frees KV, holding no lease and no prefill slot meanwhile.
                await placement.wait_for_capacity(full, _CAPACITY_POLL_S)
                if run.aborted:
                    return None
                continue
            run.num_cached_tokens = max(run.num_cached_tokens, pre.num_cached_tokens)
            mark_submitted(run)
            leg = placement.new_leg(run, decode_id, (0,))
            out = dataplane_pb2.SequenceOutput(
                request_id=leg.wire_id, index=0, token_ids=[pre.first_token_id]
            )
            if run.params.logprobs is not None and pre.HasField("first_logprobs"):
                out.logprobs.append(pre.first_logprobs)
            if pre.finished:
                out.finish_reason = _first_token_finish(run.params, pre.first_token_id, out)
            return leg, out

    def _slot(self, prefill_id: str) -> asyncio.Semaphore:
        """The prefill worker's handoffs in flight, at most `max_prefills_per_worker`."""
        slot = self._prefill_slots.get(prefill_id)
        if slot is None:
            slot = self._prefill_slots[prefill_id] = asyncio.Semaphore(
                self.config.max_prefills_per_worker
            )
        return slot

    async def _attempt(
        self, run: RequestRun, decode_id: str, prefill_id: str
    ) -> worker_pb2.PrefillResponse:
        """One handoff attempt in its `kv_lease` span. Raises _AttemptFailed (worth a retry
        elsewhere) or _DecodeFull (wait for the decode worker's capacity)."""
        d_stub, p_stub = self.pool.stub(decode_id), self.pool.stub(prefill_id)
        if d_stub is None or p_stub is None:
            missing = decode_id if d_stub is None else prefill_id
            raise _AttemptFailed(
                missing, f"worker {missing} not connected", grpc.StatusCode.UNAVAILABLE
            )
        wire_id = run.next_wire_id()
        run.used(prefill_id)
        span = spans.tracer.start_span(
            "kv_lease",
            run.trace,
            attributes={
                "llmfleet.decode_worker_id": decode_id,
                "llmfleet.prefill_worker_id": prefill_id,
            },
        )
        md = metadata(trace.set_span_in_context(span, run.trace))
        try:
            pre = await self._lease_and_prefill(
                run, wire_id, (decode_id, d_stub), (prefill_id, p_stub), md
            )
        except (_AttemptFailed, _DecodeFull) as failed:
            _end_lease_span(span, None, None, str(failed))
            raise
        except BaseException as exc:
            _end_lease_span(span, None, None, str(exc) or type(exc).__name__)
            raise
        _end_lease_span(span, run.lease, pre, None)
        return pre

    async def _lease_and_prefill(
        self,
        run: RequestRun,
        wire_id: str,
        decode: tuple[str, worker_pb2_grpc.WorkerStub],
        prefill: tuple[str, worker_pb2_grpc.WorkerStub],
        md: Metadata | None,
    ) -> worker_pb2.PrefillResponse:
        """One attempt: ReserveKV on D, Prefill on P (which pushes the KV to D). Raises
        _AttemptFailed for a failure worth a retry elsewhere (the lease is released first)."""
        (decode_id, d_stub), (prefill_id, _) = decode, prefill
        try:
            reserved = await d_stub.ReserveKV(
                worker_pb2.ReserveKVRequest(
                    request_id=wire_id,
                    num_prompt_tokens=len(run.prompt_ids),
                    ttl_ms=self.config.lease_ttl_ms,
                ),
                timeout=CONTROL_TIMEOUT_S,
                metadata=md,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                metrics.LEASES.labels("reserve_waited").inc()
                raise _DecodeFull(f"decode worker {decode_id} is full: {exc.details()}") from None
            metrics.LEASES.labels("reserve_failed").inc()
            if exc.code() in FINAL_CODES:
                raise field_error(exc.details(), "prompt") from None
            why = f"decode worker {decode_id} ReserveKV: {exc.code().name}: {exc.details()}"
            raise _AttemptFailed(decode_id, why, exc.code()) from None
        pb_lease = reserved.lease
        run.lease = Lease(
            pb_lease.lease_id,
            pb_lease.epoch,
            decode_id,
            pb_lease.kv_endpoint,
            pb_lease.expires_at_unix_ms,
            pb_lease.num_blocks,
        )
        # The prefill worker may have left while D reserved: its channel is closed then.
        p_stub = self.pool.stub(prefill_id)
        if p_stub is None:
            await self.release_now(run, "released")
            why = f"prefill worker {prefill_id} left"
            raise _AttemptFailed(prefill_id, why, grpc.StatusCode.UNAVAILABLE)
        try:
            return await p_stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=wire_id,
                    prompt_token_ids=run.prompt_ids,
                    sampling=sampling_to_pb(run.params),
                    cache_salt=run.cache_salt,
                    lease=pb_lease,
                    images=images_to_pb(run.images),
                ),
                timeout=self.config.lease_ttl_ms / 1000.0 + CONTROL_TIMEOUT_S,
                metadata=md,
            )
        except grpc.aio.AioRpcError as exc:
            await self.release_now(run, "released")
            if exc.code() in FINAL_CODES:
                raise field_error(exc.details(), "prompt") from None
            why = f"prefill worker {prefill_id} Prefill: {exc.code().name}: {exc.details()}"
            raise _AttemptFailed(prefill_id, why, exc.code()) from None

    async def start_decode(self, run: RequestRun) -> None:
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
                    reply_endpoint=self._reply_endpoint,
                    images=images_to_pb(run.images),
                ),
                timeout=CONTROL_TIMEOUT_S,
                metadata=metadata(run.trace),
            )
        except (grpc.aio.AioRpcError, Unavailable) as exc:
            expired = (
                isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() is grpc.StatusCode.FAILED_PRECONDITION
            )
            await self.release_now(run, "expired" if expired else "failed")
            await self.placement.migrate(run, lease.decode_worker_id, f"StartDecode failed: {exc}")
            return
        run.lease = None
        metrics.LEASES.labels("committed").inc()

    def release(self, run: RequestRun, outcome: str) -> None:
        """Release the open lease in the background (the request is ending)."""
        call = self._release_call(run, outcome)
        if call is not None:
            self._spawn(call)

    async def release_now(self, run: RequestRun, outcome: str) -> None:
        """Release the open lease before retrying, so a retry never holds two reservations."""
        worker_id = run.lease.decode_worker_id if run.lease is not None else ""
        call = self._release_call(run, outcome)
        if call is None:
            return
        try:
            await call
        except grpc.aio.AioRpcError as exc:  # the lease then expires on the worker by itself
            logger.info("ReleaseKV on %s failed: %s", worker_id, exc.code().name)

    def _release_call(self, run: RequestRun, outcome: str) -> Coroutine[Any, Any, Any] | None:
        """Take the run's open lease (counted as `outcome`) and make its ReleaseKV call;
        None without a lease or a connection to its decode worker."""
        lease, run.lease = run.lease, None
        if lease is None:
            return None
        metrics.LEASES.labels(outcome).inc()
        self.placement.freed(lease.decode_worker_id)
        stub = self.pool.stub(lease.decode_worker_id)
        if stub is None:
            return None
        return stub.ReleaseKV(
            worker_pb2.ReleaseKVRequest(lease_id=lease.lease_id, epoch=lease.epoch),
            timeout=CONTROL_TIMEOUT_S,
            metadata=metadata(run.trace),
        )


def _first_token_finish(
    params: SamplingParams, token_id: int, out: dataplane_pb2.SequenceOutput
) -> int:
    """Why a prefill's first token already ended the sequence."""
    if params.max_tokens == 1:
        return common_pb2.FINISH_REASON_LENGTH
    if token_id in params.stop_token_ids:
        out.stop_token_id = token_id
    return common_pb2.FINISH_REASON_STOP
