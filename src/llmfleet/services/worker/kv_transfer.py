"""Prefill -> decode KV pushes over ZMQ: `KVPusher` (prefill, DEALER) and `KVReceiver`
(decode, ROUTER on its kv_endpoint).

A push is one multipart message: a `KVTransferHeader` frame, then one frame per block, each
block laid out (num_layers, 2, block_size, num_kv_heads, head_dim) C-contiguous. A payload on
the GPU goes instead as one push of the header alone, its `cuda_ipc` naming the tensor for the
receiver to copy GPU to GPU (shared/wire/cuda_ipc.py); a receiver that cannot map it refuses
with an error starting "cuda-ipc: ", and the pusher then sends that endpoint host payloads.

A lease's blocks go in one or more pushes of at most `max_push_bytes` each (at least one
block), all sent before waiting; the receiver answers every push with a `KVTransferAck`
echoing lease id, epoch and transfer id. The pusher matches acks on all three and ignores
any other ack (stray, duplicated, from an earlier attempt), so a late ack can never complete
a newer push.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import prometheus_client
import torch
import zmq
import zmq.asyncio

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.kv_handoff import stage_payload
from llmfleet.services.worker.lease import LeaseError
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.wire.cuda_ipc import ERROR_PREFIX, IpcUnavailable, export_buffer
from llmfleet.shared.wire.service import FailedPrecondition, Unavailable, cancel_and_wait
from llmfleet.shared.wire.transport import (
    Frame,
    MalformedFrame,
    decode,
    encode,
    frame_tensor,
    recv_loop,
    tensor_frame,
)
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)

AckKey = tuple[str, int, str]  # lease id, epoch, transfer id

# direction "push": a prefill worker's whole lease transfer, first send to last ack;
# direction "receive": one accepted push on the decode worker, arrival to its blocks written.
KV_TRANSFER_BYTES = prometheus_client.Counter(
    "llmfleet:kv_transfer_bytes", "KV payload bytes moved between workers", ["direction"]
)
KV_TRANSFER_SECONDS = prometheus_client.Histogram(
    "llmfleet:kv_transfer_seconds",
    "Duration of KV transfers between workers",
    ["direction"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
KV_TRANSFER_FAILURES = prometheus_client.Counter(
    "llmfleet:kv_transfer_failures",
    "KV transfers that failed: pushes unacknowledged or rejected, pushes received and rejected",
    ["direction"],
)
for _direction in ("push", "receive"):  # exported at 0 from the start, so rate() works
    KV_TRANSFER_FAILURES.labels(_direction)


@dataclass
class PushResult:
    num_bytes: int
    transfer_us: int  # first send to last acknowledgement


async def stage_frames(engine: LLMEngine, frames: Sequence[Frame]) -> torch.Tensor:
    """Received KV frames (one block each, checked against `engine`'s block layout) as one
    payload for `engine.kv` (`write_reserved`, `import_cached_blocks`). The host copy runs on a
    pool thread beside the engine's steps, into pinned memory on a CUDA engine, so the engine
    thread only starts an asynchronous copy to the GPU."""
    shape, dtype = engine.kv.block_shape, engine.kv.dtype
    views = [frame_tensor(f, dtype, shape) for f in frames]  # zero-copy, checked sizes
    return await asyncio.to_thread(stage_payload, views, pinned=engine.device.type == "cuda")


class _Dealer:
    """One DEALER connected to one decode worker's kv_endpoint, with its ack reader."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.waiters: dict[AckKey, asyncio.Future[dataplane_pb2.KVTransferAck]] = {}
        self.reader = asyncio.create_task(
            recv_loop(self.sock, self._on_ack, name=f"kv-acks {endpoint}")
        )

    async def _on_ack(self, frames: list[Frame]) -> None:
        ack, _ = decode(frames, dataplane_pb2.KVTransferAck)
        fut = self.waiters.pop((ack.lease_id, ack.epoch, ack.transfer_id), None)
        if fut is None or fut.done():
            logger.info(
                "ignoring ack for lease %s epoch %d transfer %s (no push waits for it)",
                ack.lease_id,
                ack.epoch,
                ack.transfer_id,
            )
            return
        fut.set_result(ack)

    async def close(self) -> None:
        await cancel_and_wait(self.reader)
        self.sock.close(linger=0)
        for fut in self.waiters.values():
            fut.cancel()
        self.waiters.clear()


class KVPusher:
    """Prefill side: one DEALER per decode kv_endpoint, created on first use."""

    def __init__(self, ctx: zmq.asyncio.Context, *, max_push_bytes: int = 16 << 20) -> None:
        self.ctx = ctx
        self.max_push_bytes = max_push_bytes
        self._dealers: dict[str, _Dealer] = {}
        self.host_only: set[str] = set()  # endpoints that refused GPU payloads (CUDA IPC)
        # Since start (GetWorkerStats): bytes and time of acknowledged pushes, by path.
        self.pushed_bytes = self.push_us = self.pushes_gpu = self.pushes_host = 0

    async def push(
        self,
        endpoint: str,
        *,
        lease_id: str,
        epoch: int,
        request_id: str,
        layout: dataplane_pb2.KVLayout,
        payload: torch.Tensor,  # (nb, num_layers, 2, block_size, Hkv, D), contiguous
        timeout_s: float,
        traceparent: str = "",
    ) -> PushResult:
        """Push every block and wait for every ack. Unavailable on timeout (the dealer is then
        dropped, so nothing queued for a dead peer is sent later); FailedPrecondition when the
        receiver rejects a push; IpcUnavailable when it cannot map a GPU `payload` (the
        caller keeps the payload until this returns)."""
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            dealer = self._dealers[endpoint] = _Dealer(self.ctx, endpoint)
        nb, on_gpu = payload.shape[0], payload.is_cuda
        block_bytes = payload[0].numel() * payload.element_size() if nb else 0
        per_push = nb if on_gpu else max(1, self.max_push_bytes // max(block_bytes, 1))
        chunks = [(i, min(i + per_push, nb)) for i in range(0, nb, per_push)] or [(0, 0)]
        keys: list[AckKey] = []
        futs: list[asyncio.Future[dataplane_pb2.KVTransferAck]] = []
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                for lo, hi in chunks:
                    header = dataplane_pb2.KVTransferHeader(
                        lease_id=lease_id,
                        epoch=epoch,
                        request_id=request_id,
                        first_block=lo,
                        layout=layout,
                        transfer_id=uuid.uuid4().hex,
                        last=hi == nb,
                        traceparent=traceparent,
                    )
                    key = (lease_id, epoch, header.transfer_id)
                    fut = dealer.waiters[key] = loop.create_future()
                    keys.append(key)
                    futs.append(fut)
                    if on_gpu:
                        header.cuda_ipc.CopyFrom(export_buffer(payload))
                        frames = encode(header)
                    else:
                        frames = encode(header, [tensor_frame(payload[i]) for i in range(lo, hi)])
                    await dealer.sock.send_multipart(frames, copy=False)
                acks = await asyncio.gather(*futs)
        except TimeoutError:
            KV_TRANSFER_FAILURES.labels("push").inc()
            self._dealers.pop(endpoint, None)
            await dealer.close()
            raise Unavailable(
                f"decode worker at {endpoint} did not acknowledge the KV of lease {lease_id} "
                f"within {timeout_s * 1000:.0f} ms"
            ) from None
        finally:
            for k in keys:
                dealer.waiters.pop(k, None)
        for ack in acks:
            if not ack.ok and on_gpu and ack.error.startswith(ERROR_PREFIX):
                self.host_only.add(endpoint)
                raise IpcUnavailable(ack.error.removeprefix(ERROR_PREFIX))
            if not ack.ok:
                KV_TRANSFER_FAILURES.labels("push").inc()
                raise FailedPrecondition(f"decode worker rejected the KV push: {ack.error}")
        seconds = time.perf_counter() - start
        KV_TRANSFER_BYTES.labels("push").inc(nb * block_bytes)
        KV_TRANSFER_SECONDS.labels("push").observe(seconds)
        result = PushResult(num_bytes=nb * block_bytes, transfer_us=int(seconds * 1e6))
        self.pushed_bytes += result.num_bytes
        self.push_us += result.transfer_us
        if on_gpu:
            self.pushes_gpu += 1
        else:
            self.pushes_host += 1
        return result

    async def close(self) -> None:
        for dealer in self._dealers.values():
            await dealer.close()
        self._dealers.clear()


def payload_bytes(header: dataplane_pb2.KVTransferHeader, frames: list[Frame]) -> int:
    """A push's KV bytes: its frames', or the GPU tensor's it names."""
    if not header.HasField("cuda_ipc"):
        return sum(len(f) for f in frames)
    buf = header.cuda_ipc
    return math.prod(buf.shape) * torch.empty((), dtype=getattr(torch, buf.dtype)).element_size()


# (header, payload frames) -> None when accepted; raises LeaseError/MalformedFrame to reject.
PushHandler = Callable[[dataplane_pb2.KVTransferHeader, list[Frame]], Awaitable[None]]


class KVReceiver:
    """Decode side: a ROUTER on kv_endpoint. Each push is handed to `handler`; the sender gets
    an ack (ok, or ok=false with the reason). A message whose header does not parse cannot be
    acknowledged: it is logged and dropped, and the loop goes on."""

    def __init__(self, sock: zmq.asyncio.Socket, handler: PushHandler) -> None:
        self.sock = sock
        self._handler = handler
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(recv_loop(self.sock, self._on_message, name="kv-recv"))

    async def _on_message(self, frames: list[Frame]) -> None:
        if len(frames) < 2:
            raise MalformedFrame(f"{len(frames)} frames: no routing id and header")
        start = time.perf_counter()
        identity, rest = frames[0], frames[1:]
        header, payload = decode(rest, dataplane_pb2.KVTransferHeader)
        if not header.lease_id or not header.transfer_id:
            raise MalformedFrame("push without lease_id or transfer_id")
        ack = dataplane_pb2.KVTransferAck(
            lease_id=header.lease_id, epoch=header.epoch, transfer_id=header.transfer_id, ok=True
        )
        try:
            await self._handler(header, payload)
        except (LeaseError, MalformedFrame, LLMFleetError, ValueError) as e:
            ack.ok, ack.error = False, str(e)
            KV_TRANSFER_FAILURES.labels("receive").inc()
            logger.info("rejected KV push for lease %s: %s", header.lease_id, e)
        else:
            KV_TRANSFER_BYTES.labels("receive").inc(payload_bytes(header, payload))
            KV_TRANSFER_SECONDS.labels("receive").observe(time.perf_counter() - start)
        await self.sock.send_multipart([identity, *encode(ack)])

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        self.sock.close(linger=0)
