"""KV-event publishing: which block hashes a publisher (worker or kvstore) holds.

The publisher keeps the set it has announced, so a snapshot and the event sequence always
agree: `snapshot()` carries the seq of the last batch the set reflects. Subscribers apply
batches with seq = last + 1; on a gap they fetch a snapshot over gRPC (`GetKVSnapshot`) and
resume after its seq. Seq counts from 1 within an epoch, picked at random per publisher
instance, so a subscriber tells a restarted publisher's seq 1 from an old one (and resyncs).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable

import zmq
import zmq.asyncio

from llmfleet.shared.core.kv_index import KVSnapshot
from llmfleet.shared.wire.transport import bind
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        host: str,
        publisher_id: str,
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self.publisher_id = publisher_id
        self.sock, self.endpoint = bind(ctx, zmq.PUB, host, port, advertise_host)
        self.epoch = secrets.randbits(63) or 1  # this run's id in every batch; 0: none
        self.seq = 0
        self._held: set[bytes] = set()

    async def publish(
        self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (), cleared: bool = False
    ) -> None:
        stored, removed = list(stored), list(removed)
        if not (stored or removed or cleared):
            return
        if cleared:
            self._held.clear()
        self._held.difference_update(removed)
        self._held.update(stored)
        self.seq += 1
        batch = dataplane_pb2.KVEventBatch(
            publisher_id=self.publisher_id,
            seq=self.seq,
            stored=stored,
            removed=removed,
            cleared=cleared,
            epoch=self.epoch,
        )
        await self.sock.send(batch.SerializeToString())

    def snapshot(self) -> KVSnapshot:
        """The set announced so far, as of batch `seq` of this `epoch`."""
        return KVSnapshot(self.publisher_id, self.seq, tuple(self._held), epoch=self.epoch)

    def close(self) -> None:
        self.sock.close(linger=0)
