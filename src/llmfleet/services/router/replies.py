"""The router's reply endpoint: one PULL socket receiving `TokenBatch` from every worker.

Each batch is split by request id and handed to the sink registered for that id (the request's
queue); outputs for ids nobody registered (finished, cancelled or migrated requests) are dropped.
This is the per-token hot path: one parse per batch, one dict lookup per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from llmfleet.shared.wire.transport import Frame, bind, decode, recv_loop
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)

# sink(worker_id, outputs of one request in one engine step)
Sink = Callable[[str, Sequence[dataplane_pb2.SequenceOutput]], None]


class ReplyReceiver:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        host: str,
        on_batch: Callable[[str], None] | None = None,
        advertise_host: str | None = None,
    ) -> None:
        """`on_batch(worker_id)`: called for every batch received (a sign of life)."""
        self._sock, self.endpoint = bind(ctx, zmq.PULL, host, advertise_host=advertise_host)
        self._sinks: dict[str, Sink] = {}
        self._on_batch_from = on_batch
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0

    def start(self) -> None:
        self._task = asyncio.create_task(recv_loop(self._sock, self._on_batch, name="replies"))

    def register(self, wire_id: str, sink: Sink) -> None:
        self._sinks[wire_id] = sink

    def unregister(self, wire_id: str) -> None:
        self._sinks.pop(wire_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)
        await asyncio.sleep(0)

    async def _on_batch(self, frames: list[Frame]) -> None:
        batch, _ = decode(frames, dataplane_pb2.TokenBatch)
        if self._on_batch_from is not None:
            self._on_batch_from(batch.worker_id)
        outputs = batch.outputs
        if len(outputs) == 1:
            self._deliver(batch.worker_id, outputs[0].request_id, outputs)
            return
        groups: dict[str, list[dataplane_pb2.SequenceOutput]] = {}
        for out in outputs:
            groups.setdefault(out.request_id, []).append(out)
        for request_id, outs in groups.items():
            self._deliver(batch.worker_id, request_id, outs)

    def _deliver(
        self, worker_id: str, request_id: str, outs: Sequence[dataplane_pb2.SequenceOutput]
    ) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            self.num_dropped += len(outs)
            return
        sink(worker_id, outs)


def merge_outputs(
    outs: Sequence[dataplane_pb2.SequenceOutput],
) -> Sequence[dataplane_pb2.SequenceOutput]:
    """Outputs of several consecutive steps of one request, one per completion index: the
    token ids and logprobs joined in order, draft counts summed, the ending (finish reason, stop
    token) of the last.
    Returns `outs` itself when no index repeats."""
    by_index: dict[int, list[dataplane_pb2.SequenceOutput]] = {}
    for out in outs:
        by_index.setdefault(out.index, []).append(out)
    if len(by_index) == len(outs):
        return outs
    merged = []
    for parts in by_index.values():
        if len(parts) == 1:
            merged.append(parts[0])
            continue
        m = dataplane_pb2.SequenceOutput()
        m.CopyFrom(parts[-1])
        del m.token_ids[:]
        del m.logprobs[:]
        for part in parts:
            m.token_ids.extend(part.token_ids)
            m.logprobs.extend(part.logprobs)
        m.num_cached_tokens = max(p.num_cached_tokens for p in parts)
        m.num_draft_tokens = sum(p.num_draft_tokens for p in parts)
        m.num_accepted_tokens = sum(p.num_accepted_tokens for p in parts)
        merged.append(m)
    return merged
