"""KV-event subscriptions: one ZMQ SUB socket per publisher feeding the KV index, and snapshot
resyncs over gRPC (`GetKVSnapshot`) whenever the index asks for one. The router subscribes
to its workers; a worker subscribes to the kvstore."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from llmfleet.shared.core.kv_index import KVEvents, KVIndex, KVSnapshot
from llmfleet.shared.wire.transport import Frame, decode, recv_loop
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)

SnapshotFetcher = Callable[[str], Awaitable[KVSnapshot]]


class KVSubscriber:
    """Owns the KV index. Events are keyed by the worker whose socket delivered them."""

    def __init__(self, ctx: zmq.asyncio.Context, fetch_snapshot: SnapshotFetcher) -> None:
        self._ctx = ctx
        self._fetch = fetch_snapshot
        self.index = KVIndex(self._schedule_snapshot)
        self._subs: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._fetching: set[asyncio.Task[None]] = set()
        self.num_snapshots = 0

    def subscribe(self, worker_id: str, endpoint: str) -> None:
        """(Re)subscribe to a worker's events and resync it from a snapshot."""
        self.unsubscribe(worker_id)
        if endpoint:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)

            async def on_message(frames: list[Frame]) -> None:
                self._on_events(worker_id, frames)

            task = asyncio.create_task(recv_loop(sock, on_message, name=f"kv-events {worker_id}"))
            self._subs[worker_id] = (sock, task)
        self.index.add_publisher(worker_id)

    def unsubscribe(self, worker_id: str) -> None:
        entry = self._subs.pop(worker_id, None)
        if entry is not None:
            sock, task = entry
            task.cancel()
            sock.close(linger=0)
        self.index.remove_publisher(worker_id)

    async def close(self) -> None:
        for worker_id in list(self._subs):
            self.unsubscribe(worker_id)
        for task in list(self._fetching):
            task.cancel()
        await asyncio.sleep(0)

    def _on_events(self, worker_id: str, frames: list[Frame]) -> None:
        batch, _ = decode(frames, dataplane_pb2.KVEventBatch)
        self.index.apply(
            KVEvents(
                publisher_id=worker_id,
                seq=batch.seq,
                stored=tuple(batch.stored),
                removed=tuple(batch.removed),
                cleared=batch.cleared,
                epoch=batch.epoch,
            )
        )

    def _schedule_snapshot(self, worker_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._resync(worker_id))
        self._fetching.add(task)
        task.add_done_callback(self._fetching.discard)

    async def _resync(self, worker_id: str) -> None:
        try:
            snap = await self._fetch(worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure: stay stale, the next event asks again
            logger.warning("KV snapshot of %s failed: %s", worker_id, exc)
            self.index.snapshot_failed(worker_id)
            return
        self.num_snapshots += 1
        self.index.apply_snapshot(
            KVSnapshot(worker_id, snap.seq, snap.block_hashes, epoch=snap.epoch)
        )
