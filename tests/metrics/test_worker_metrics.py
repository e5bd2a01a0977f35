"""Worker metrics on paths the fleet test does not take: every lease ending (expiry included)
is counted once by how it ended, and KV pushes count bytes when acknowledged and failures
when rejected or unanswered."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from llmfleet.services.worker.kv_transfer import KVPusher, KVReceiver
from llmfleet.services.worker.lease import LeaseError, LeaseTable
from llmfleet.shared.wire.service import FailedPrecondition, Unavailable
from llmfleet.shared.wire.transport import bind
from llmfleet.v1 import dataplane_pb2


def count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def lease_counts() -> dict[str, float]:
    states = ("reserved", "committed", "released", "expired")
    return {s: count("llmfleet:kv_leases_total", state=s) for s in states}


def test_each_lease_is_counted_when_granted_and_once_when_it_ends():
    now = [100.0]
    table = LeaseTable(lambda: now[0])
    before = lease_counts()
    committed = table.grant("a", 4, 1, 1.0)
    table.record_push(table.check_push(committed.lease_id, committed.epoch, 0, 1), 0, 1)
    table.commit(committed.lease_id, committed.epoch, "a")
    released = table.grant("b", 4, 1, 1.0)
    table.release(released.lease_id, released.epoch)
    table.release(released.lease_id, released.epoch)  # a second release ends nothing
    expired = table.grant("c", 4, 1, 1.0)
    now[0] += 2.0
    with pytest.raises(LeaseError, match="expired"):
        table.get(expired.lease_id, expired.epoch)  # found expired by an operation ...
    assert table.expire() == [expired]  # ... and reported by the sweep, counted once
    after = lease_counts()
    assert {s: after[s] - before[s] for s in after} == {
        "reserved": 3,
        "committed": 1,
        "released": 1,
        "expired": 1,
    }


def _push(pusher: KVPusher, endpoint: str, payload: torch.Tensor, timeout_s: float):
    return pusher.push(
        endpoint,
        lease_id="L",
        epoch=1,
        request_id="r",
        layout=dataplane_pb2.KVLayout(num_layers=1, block_size=2, num_kv_heads=1, head_dim=4),
        payload=payload,
        timeout_s=timeout_s,
    )


def test_kv_push_bytes_seconds_and_failures():
    payload = torch.zeros(3, 1, 2, 2, 1, 4)  # 3 blocks of 64 bytes
    bytes_name, seconds_name = (
        "llmfleet:kv_transfer_bytes_total",
        "llmfleet:kv_transfer_seconds_count",
    )
    failures_name = "llmfleet:kv_transfer_failures_total"

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        accept = [True]

        async def handler(header, frames) -> None:
            if not accept[0]:
                raise LeaseError("no such lease")

        sock, endpoint = bind(ctx, zmq.ROUTER, "127.0.0.1")
        receiver = KVReceiver(sock, handler)
        receiver.start()
        silent, silent_endpoint = bind(ctx, zmq.ROUTER, "127.0.0.1")  # never answers
        pusher = KVPusher(ctx)
        try:
            b0 = {d: count(bytes_name, direction=d) for d in ("push", "receive")}
            s0 = {d: count(seconds_name, direction=d) for d in ("push", "receive")}
            f0 = {d: count(failures_name, direction=d) for d in ("push", "receive")}
            result = await _push(pusher, endpoint, payload, 5.0)
            assert result.num_bytes == 3 * 64
            for d in ("push", "receive"):
                assert count(bytes_name, direction=d) - b0[d] == 3 * 64, d
                assert count(seconds_name, direction=d) - s0[d] == 1, d
            accept[0] = False
            with pytest.raises(FailedPrecondition, match="rejected"):
                await _push(pusher, endpoint, payload, 5.0)
            with pytest.raises(Unavailable, match="did not acknowledge"):
                await _push(pusher, silent_endpoint, payload, 0.2)
            assert count(failures_name, direction="push") - f0["push"] == 2
            assert count(failures_name, direction="receive") - f0["receive"] == 1
            # Failed transfers moved no counted bytes.
            for d in ("push", "receive"):
                assert count(bytes_name, direction=d) - b0[d] == 3 * 64, d
        finally:
            await pusher.close()
            await receiver.stop()
            silent.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(body())
