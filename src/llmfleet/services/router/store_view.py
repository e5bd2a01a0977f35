"""The router's view of the kvstore: which block hashes it holds, from its KV events (resynced
by `GetKVSnapshot` on a gap or a restart), so routing can count a prompt prefix the store holds
as fetched by whichever worker runs the request, not recomputed.

    view = StoreView(ctx, "host:port", "tcp://host:events_port")
    view.start()
    view.matched_prefix(block_hashes)    # leading blocks the store holds (0 while out of sync)
    await view.close()
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq.asyncio

from llmfleet.shared.core.kv_index import KVSnapshot
from llmfleet.shared.wire.kv_subscriber import KVSubscriber
from llmfleet.shared.wire.limits import channel_options
from llmfleet.shared.wire.tls import FleetTLS, aio_channel
from llmfleet.v1 import kvstore_pb2_grpc, worker_pb2

_STORE = "kvstore"  # the view's one publisher
_SNAPSHOT_TIMEOUT_S = 10.0


class StoreView:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        events_endpoint: str,
        tls: FleetTLS | None = None,
    ) -> None:
        self._channel = aio_channel(address, tls, channel_options())
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._events_endpoint = events_endpoint
        self._sub = KVSubscriber(ctx, self._snapshot)

    def start(self) -> None:
        self._sub.subscribe(_STORE, self._events_endpoint)

    def matched_prefix(self, hashes: Sequence[bytes]) -> int:
        return self._sub.index.matched_prefix(_STORE, hashes)

    async def close(self) -> None:
        await self._sub.close()
        await self._channel.close()

    async def _snapshot(self, publisher: str) -> KVSnapshot:
        resp = await self._stub.GetKVSnapshot(
            worker_pb2.GetKVSnapshotRequest(), timeout=_SNAPSHOT_TIMEOUT_S
        )
        return KVSnapshot(publisher, resp.seq, tuple(resp.block_hashes), epoch=resp.epoch)
