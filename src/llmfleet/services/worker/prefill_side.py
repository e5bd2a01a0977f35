"""The prefill side of the KV lease handoff: prefill a prompt, push its KV, answer the first token.

    prefill = PrefillSide(ctx, engine_loop, admit, kv_layout, kv_push_timeout_ms=...)
    resp = await prefill.prefill(request)    # PrefillResponse once every push is acknowledged
    prefill.take(output)                      # engine loop: True when a prefill waited for it
    await prefill.close()

A prefill is an ordinary engine request admitted `prefill_only`: the engine computes the prompt,
samples the first token and keeps the prompt's blocks pinned until the request is aborted. The
first output completes the waiting `prefill` call (it never goes to a reply endpoint); the
blocks are read out, pushed to the decode worker named by the lease, and the request is aborted
whatever happens, which unpins the blocks (they stay in the prefix cache).

On CUDA (`kv_transfer` "auto") the blocks are read into a fresh GPU tensor that the decode
worker copies from GPU to GPU (CUDA IPC, shared/wire/cuda_ipc.py); a decode worker that cannot
map it (another host, no GPU) refuses, and that push and every later one to it go through
host memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import zmq.asyncio
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from llmfleet.engine.request import RequestOutput
from llmfleet.services.worker.decode_side import EngineAccess
from llmfleet.services.worker.kv_transfer import KVPusher
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.core.multimodal import ImageRef
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import images_from_pb, logprobs_to_pb, sampling_from_pb
from llmfleet.shared.wire.cuda_ipc import IpcUnavailable
from llmfleet.shared.wire.service import FailedPrecondition
from llmfleet.shared.wire.tracing import child_span, traceparent
from llmfleet.v1 import dataplane_pb2, worker_pb2

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# admit(request_id, prompt, params, cache_salt, images) -> prompt tokens found cached
# (prefill_only).
Admit = Callable[[str, list[int], SamplingParams, str, tuple[ImageRef, ...]], Awaitable[int]]


class Cancelled(LLMFleetError):
    """The request was cancelled while the RPC waited for it."""


class PrefillSide:
    """Prefills of one prefill (or unified) worker. Owned by the worker's event loop."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        engine_loop: EngineAccess,
        admit: Admit,
        kv_layout: dataplane_pb2.KVLayout,
        *,
        kv_push_timeout_ms: int,
        kv_transfer: str = "auto",
    ) -> None:
        self._engine_loop = engine_loop
        self._admit = admit
        self.kv_layout = kv_layout
        self._kv_push_timeout_ms = kv_push_timeout_ms
        self._kv_transfer = kv_transfer
        self.pusher = KVPusher(ctx)
        self._waiting: dict[str, asyncio.Future[RequestOutput]] = {}

    def take(self, out: RequestOutput) -> bool:
        """Hand a step output to the prefill waiting for it; False when none waits."""
        fut = self._waiting.get(out.request_id)
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(out)
        return True

    def fail_all(self, error: LLMFleetError) -> None:
        """The worker failed: every prefill waiting for its first token fails with `error`."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)

    async def close(self) -> None:
        await self.pusher.close()

    async def prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        """Raises Cancelled when the request was aborted meanwhile, LLMFleetError otherwise."""
        rid = request.request_id
        engine, loop = self._engine_loop()
        lease = request.lease
        if not lease.lease_id:
            raise ValidationError("lease.lease_id", "must be set")
        if not lease.kv_endpoint:
            raise ValidationError("lease.kv_endpoint", "must be set")
        if lease.expires_at_unix_ms and lease.expires_at_unix_ms <= time.time() * 1000:
            raise FailedPrecondition(f"lease {lease.lease_id} expired before the prefill")
        if rid in self._waiting:
            raise ValidationError("request_id", f"{rid!r} is already in use")
        params = sampling_from_pb(request.sampling)
        prompt = list(request.prompt_token_ids)
        images = images_from_pb(request.images, len(prompt), "images")
        fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        admitted = False
        try:
            await self._admit(rid, prompt, params, request.cache_salt, images)
            admitted = True
            out = await fut
            if out.finish_reason == "abort" or not out.new_token_ids:
                raise Cancelled(f"request {rid} was cancelled during its prefill")
            kv = engine.kv
            on_gpu = (
                self._kv_transfer == "auto"
                and engine.device.type == "cuda"
                and lease.kv_endpoint not in self.pusher.host_only
            )
            # The copy (to the host, or to a fresh GPU tensor) runs beside later steps (the pin
            # keeps the blocks); the engine thread only starts it.
            ids = kv.pinned_block_ids
            read = await loop.call(lambda: kv.start_read(ids(rid), to_host=not on_gpu))
            payload = await asyncio.to_thread(read.wait)
            if lease.num_blocks and payload.shape[0] != lease.num_blocks:
                raise FailedPrecondition(
                    f"the prompt has {payload.shape[0]} blocks, the lease {lease.num_blocks}"
                )
            attrs = {
                "llmfleet.lease.id": lease.lease_id,
                "llmfleet.lease.epoch": lease.epoch,
                "llmfleet.kv.num_blocks": payload.shape[0],
            }
            # The decode side's kv_receive spans are children of this one (traceparent in
            # every KVTransferHeader), which links the two workers' halves of the transfer.
            with child_span(tracer, "kv_push", kind=SpanKind.PRODUCER, attributes=attrs) as span:
                push = functools.partial(
                    self.pusher.push,
                    lease.kv_endpoint,
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    request_id=rid,
                    layout=self.kv_layout,
                    timeout_s=self._kv_push_timeout_ms / 1000,
                    traceparent=traceparent(),
                )
                try:
                    pushed = await push(payload=payload)
                except IpcUnavailable as e:
                    logger.warning("KV to %s through host memory: %s", lease.kv_endpoint, e)
                    on_gpu = False
                    pushed = await push(payload=await asyncio.to_thread(payload.cpu))
                span.set_attribute("llmfleet.kv.gpu_to_gpu", on_gpu)
                span.set_attribute("llmfleet.kv.bytes", pushed.num_bytes)
                span.set_attribute("llmfleet.kv.transfer_s", pushed.transfer_us / 1e6)
        finally:
            self._waiting.pop(rid, None)
            if admitted:
                loop.call_soon(engine.abort, rid)  # releases the pinned blocks
        resp = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            kv_bytes=pushed.num_bytes,
            kv_transfer_us=pushed.transfer_us,
            finished=out.finish_reason in ("stop", "length"),
        )
        first_lp = out.new_logprobs[0] if out.new_logprobs else None
        if first_lp is not None:
            resp.first_logprobs.CopyFrom(logprobs_to_pb(first_lp))
        return resp
