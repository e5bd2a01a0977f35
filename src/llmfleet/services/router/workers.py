"""gRPC channels to the registered workers, and fast detection of a dead one.

One channel per worker. A watcher task follows the channel's connectivity: once a channel that
was connected drops and cannot reconnect (TRANSIENT_FAILURE), `on_failure(worker_id)` is called
so the router can migrate the worker's requests without waiting for heartbeats to time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llmfleet.shared.wire.limits import channel_options
from llmfleet.shared.wire.tls import FleetTLS, aio_channel
from llmfleet.v1 import worker_pb2_grpc

logger = logging.getLogger(__name__)

# Longer than any call the router makes to a worker lasts (its own timeout: AddRequest 60 s).
_CLOSE_GRACE_S = 90.0
_DEAD_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


@dataclass
class _Conn:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    watcher: asyncio.Task[None] | None = None


class WorkerPool:
    def __init__(self, on_failure: Callable[[str], None], tls: FleetTLS | None = None) -> None:
        self._on_failure = on_failure
        self._tls = tls  # mutual TLS to every worker
        self._conns: dict[str, _Conn] = {}

    def connect(self, worker_id: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The worker's stub; a new channel when the worker is new or moved."""
        conn = self._conns.get(worker_id)
        if conn is not None and conn.address == address:
            return conn.stub
        if conn is not None:
            self._drop(conn)
        channel = aio_channel(address, self._tls, channel_options())
        conn = _Conn(address, channel, worker_pb2_grpc.WorkerStub(channel))
        conn.watcher = asyncio.create_task(self._watch(worker_id, conn))
        self._conns[worker_id] = conn
        return conn.stub

    def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub | None:
        conn = self._conns.get(worker_id)
        return None if conn is None else conn.stub

    def is_broken(self, worker_id: str) -> bool:
        """True when the worker's channel cannot connect (a dead peer, not an RPC's status)."""
        conn = self._conns.get(worker_id)
        return conn is None or conn.channel.get_state() in _DEAD_STATES

    def disconnect(self, worker_id: str) -> None:
        conn = self._conns.pop(worker_id, None)
        if conn is not None:
            self._drop(conn)

    async def close(self) -> None:
        for conn in self._conns.values():
            self._drop(conn, 0.0)  # the router is stopping: nothing waits for these calls
        self._conns.clear()
        await asyncio.sleep(0)

    def _drop(self, conn: _Conn, grace_s: float = _CLOSE_GRACE_S) -> None:
        if conn.watcher is not None:
            conn.watcher.cancel()
        # Closing a channel cancels the RPCs still on it, and their callers see a bare
        # asyncio.CancelledError, as if the request itself were cancelled. So the calls in
        # flight end first, with their own status: a dead worker's fail at once (UNAVAILABLE),
        # a hung one's at their deadline, within the grace.
        task = asyncio.create_task(conn.channel.close(grace=grace_s))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _watch(self, worker_id: str, conn: _Conn) -> None:
        seen_ready = False
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                state = conn.channel.get_state(try_to_connect=True)
                if state is grpc.ChannelConnectivity.READY:
                    seen_ready = True
                elif state in _DEAD_STATES and seen_ready:
                    logger.warning("worker %s at %s: connection lost", worker_id, conn.address)
                    if self._conns.get(worker_id) is conn:
                        self._on_failure(worker_id)
                    return
                await conn.channel.wait_for_state_change(state)
