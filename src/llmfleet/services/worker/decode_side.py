"""The decode side of the KV lease handoff: reservations, pushed blocks, start, release, expiry.

    decode = DecodeSide(engine_loop, kv_layout, kv_endpoint_sock, routes, lease_ttl_ms=...)
    decode.start()                             # KV receiver + expiry sweeper
    lease_pb = await decode.reserve(request)   # ReserveKV
    ... the prefill worker pushes blocks: `on_push` writes them into the reservation ...
    await decode.start_decode(request)         # StartDecode: the sequence joins the engine
    released = await decode.release(request)   # ReleaseKV
    await decode.close()                       # every open lease released, sockets closed

The `LeaseTable` owns lease state; the engine's `kv` (engine/kv_handoff.py) holds the reserved
blocks. Every path that ends a lease (release, expiry, a failed start, shutdown) frees its
blocks through the engine loop, so blocks are never freed while a step reads them. Expiry is
checked before every lease operation and by a periodic sweep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
import zmq.asyncio
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from llmfleet.engine.engine import LLMEngine
from llmfleet.services.worker.kv_transfer import KVReceiver, payload_bytes, stage_frames
from llmfleet.services.worker.lease import LeaseError, LeaseTable
from llmfleet.services.worker.loop import EngineLoop
from llmfleet.services.worker.request_spans import RequestSpans
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.convert import images_from_pb, sampling_from_pb
from llmfleet.shared.wire.cuda_ipc import IpcUnavailable, open_buffer
from llmfleet.shared.wire.service import FailedPrecondition, cancel_and_wait
from llmfleet.shared.wire.tracing import context_from_traceparent
from llmfleet.shared.wire.transport import Frame
from llmfleet.v1 import dataplane_pb2, worker_pb2

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# Returns the engine and its loop, or raises FailedPrecondition when the worker is not serving.
EngineAccess = Callable[[], tuple[LLMEngine, EngineLoop]]


def open_gpu_payload(engine: LLMEngine, buf: dataplane_pb2.CudaIpcBuffer) -> torch.Tensor:
    """A pushed GPU payload mapped here; IpcUnavailable when it cannot be (the pusher then
    sends host payloads), ValueError when it is not this engine's block layout."""
    if engine.device.type != "cuda":
        raise IpcUnavailable("this worker's KV cache is not on a GPU")
    payload = open_buffer(buf)
    want = tuple(engine.kv.block_shape)
    if tuple(payload.shape[1:]) != want or payload.dtype != engine.kv.dtype:
        raise ValueError(
            f"GPU payload {tuple(payload.shape)} {payload.dtype} is not blocks of {want} "
            f"{engine.kv.dtype}"
        )
    return payload


class DecodeSide:
    """Leases of one decode (or unified) worker. Owned by the worker's event loop."""

    def __init__(
        self,
        engine_loop: EngineAccess,
        kv_layout: dataplane_pb2.KVLayout,
        sock: zmq.asyncio.Socket,
        kv_endpoint: str,
        routes: dict[str, str],
        request_spans: RequestSpans,
        *,
        lease_ttl_ms: int,
    ) -> None:
        self._engine_loop = engine_loop
        self.kv_layout = kv_layout
        self.kv_endpoint = kv_endpoint
        self.leases = LeaseTable()
        self._routes = routes  # request id -> reply endpoint (shared with the worker)
        self._lease_ttl_ms = lease_ttl_ms
        self._request_spans = request_spans
        self.receiver = KVReceiver(sock, self.on_push)
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.receiver.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="lease-sweeper")

    async def stop_sweeping(self) -> None:
        await cancel_and_wait(self._sweeper)
        self._sweeper = None

    def release_all(self, loop: EngineLoop, engine: LLMEngine) -> None:
        """Shutdown: end every open lease and free its blocks (queued on the engine loop)."""
        for lease in self.leases.active():
            self.leases.release(lease.lease_id, lease.epoch)
            loop.call_soon(engine.kv.release_reserved, lease.lease_id)

    async def close(self) -> None:
        await self.stop_sweeping()
        await self.receiver.stop()

    # ---- RPCs (callers map LLMFleetError to a status) -----------------------------------------
    async def reserve(self, request: worker_pb2.ReserveKVRequest) -> worker_pb2.KVLease:
        engine, loop = self._engine_loop()
        if not request.request_id:
            raise ValidationError("request_id", "must not be empty")
        if request.num_prompt_tokens < 1:
            raise ValidationError("num_prompt_tokens", "must be >= 1")
        if request.ttl_ms < 0:
            raise ValidationError("ttl_ms", f"must be >= 0, got {request.ttl_ms}")
        self.reap()
        ttl_ms = request.ttl_ms or self._lease_ttl_ms
        num_blocks = engine.block_manager.blocks_needed(request.num_prompt_tokens)
        lease = self.leases.grant(
            request.request_id, request.num_prompt_tokens, num_blocks, ttl_ms / 1000
        )
        try:
            await loop.call(engine.kv.reserve, lease.lease_id, request.num_prompt_tokens)
        except BaseException:
            self.leases.release(lease.lease_id, lease.epoch)
            raise
        return worker_pb2.KVLease(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            expires_at_unix_ms=lease.expires_at_ms,
            kv_endpoint=self.kv_endpoint,
            num_blocks=lease.num_blocks,
        )

    async def on_push(self, header: dataplane_pb2.KVTransferHeader, frames: list[Frame]) -> None:
        """A KV push for a lease: validated, then written into the reservation (between steps).
        Raises LeaseError / MalformedFrame to reject it (the receiver acks ok=false). A traced
        push is one `kv_receive` span, child of the prefill worker's `kv_push`."""
        parent = context_from_traceparent(header.traceparent)
        if parent is None:
            await self._accept_push(header, frames)
            return
        attrs = {
            "llmfleet.lease.id": header.lease_id,
            "llmfleet.lease.epoch": header.epoch,
            "llmfleet.kv.first_block": header.first_block,
            "llmfleet.kv.num_blocks": len(frames),
        }
        with tracer.start_as_current_span("kv_receive", parent, SpanKind.CONSUMER, attrs):
            await self._accept_push(header, frames)

    async def _accept_push(
        self, header: dataplane_pb2.KVTransferHeader, frames: list[Frame]
    ) -> None:
        engine, loop = self._engine_loop()
        self.reap()
        on_gpu = header.HasField("cuda_ipc")
        num_blocks = header.cuda_ipc.shape[0] if on_gpu and header.cuda_ipc.shape else len(frames)
        lease = self.leases.check_push(
            header.lease_id, header.epoch, header.first_block, num_blocks
        )
        if header.request_id != lease.request_id:
            raise LeaseError(f"lease {lease.lease_id} is not for request {header.request_id!r}")
        if header.layout != self.kv_layout:
            raise LeaseError(f"KV layout {header.layout} is not this worker's {self.kv_layout}")
        nbytes = payload_bytes(header, frames)
        trace.get_current_span().set_attribute("llmfleet.kv.bytes", nbytes)
        if on_gpu:
            payload = open_gpu_payload(engine, header.cuda_ipc)
        else:
            payload = await stage_frames(engine, frames)

        def write() -> torch.cuda.Event | None:
            engine.kv.write_reserved(lease.lease_id, header.first_block, payload)
            if not on_gpu:
                return None
            copied = torch.cuda.Event()  # the sender frees its tensor once acknowledged
            copied.record()
            return copied

        try:
            copied = await loop.call(write)
        except KeyError:
            raise LeaseError(f"lease {lease.lease_id} was released") from None
        if copied is not None:  # (a mapped GPU payload is unmapped when this returns)
            await asyncio.to_thread(copied.synchronize)
        self.leases.record_push(lease, header.first_block, num_blocks)

    async def start_decode(self, request: worker_pb2.StartDecodeRequest) -> None:
        engine, loop = self._engine_loop()
        if not request.reply_endpoint:
            raise ValidationError("reply_endpoint", "must be set")
        params = sampling_from_pb(request.sampling)
        prompt = list(request.prompt_token_ids)
        images = images_from_pb(request.images, len(prompt), "images")
        grammars = engine.intake.grammars
        if params.structured_output is not None and grammars is not None:
            # Off the engine thread (see admission.py); start_decode then finds it cached.
            await asyncio.to_thread(grammars.compile, params.structured_output)
        self.reap()
        try:
            lease = self.leases.get(request.lease_id, request.epoch)
            if lease.num_prompt_tokens != len(prompt):
                raise ValidationError(
                    "prompt_token_ids",
                    f"{len(prompt)} tokens, the lease was for {lease.num_prompt_tokens}",
                )
            self.leases.commit(request.lease_id, request.epoch, request.request_id)
        except LeaseError as e:
            self.reap()
            raise FailedPrecondition(str(e)) from None
        rid = request.request_id
        routes = self._routes
        rpc_span = trace.get_current_span()  # StartDecode's: the decode span's parent

        def start() -> None:
            # Routed first: a first token that already ends the sequence emits its final
            # output from start_decode itself, and that output must reach the requester.
            routes[rid] = request.reply_endpoint
            try:
                engine.start_decode(
                    lease.lease_id,
                    rid,
                    prompt,
                    request.first_token_id,
                    params,
                    cache_salt=request.cache_salt,
                    images=images,
                )
            except BaseException:
                routes.pop(rid, None)
                engine.kv.release_reserved(lease.lease_id)
                raise
            self._request_spans.expect(rpc_span)
            loop.post(self._request_spans.decoding, rid, rpc_span, len(prompt))

        await loop.call(start)

    async def release(self, request: worker_pb2.ReleaseKVRequest) -> bool:
        engine, loop = self._engine_loop()
        self.reap()
        lease = self.leases.release(request.lease_id, request.epoch)
        if lease is None:
            return False
        await loop.call(engine.kv.release_reserved, lease.lease_id)
        return True

    # ---- expiry ------------------------------------------------------------------------------
    def reap(self) -> None:
        """Free the blocks of every lease that expired (sweeper, and before lease operations)."""
        try:
            engine, loop = self._engine_loop()
        except FailedPrecondition:
            return
        for lease in self.leases.expire():
            logger.info("lease %s of request %s expired", lease.lease_id, lease.request_id)
            loop.call_soon(engine.kv.release_reserved, lease.lease_id)

    async def _sweep(self) -> None:
        period = min(0.25, max(0.01, self._lease_ttl_ms / 10_000))
        while True:
            await asyncio.sleep(period)
            self.reap()
