"""In-process kvstore server + KVStoreClient over loopback: data plane, events, stats, errors."""

from __future__ import annotations

import asyncio
import hashlib
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import zmq
import zmq.asyncio

from llmfleet.services.kvstore.server import KVStoreServer, serve
from llmfleet.services.worker.kvstore_client import KVStoreClient, KVStoreError
from llmfleet.shared.core.config import KVStoreConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.transport import frame_tensor, kv_layout_key, tensor_frame
from llmfleet.v1 import dataplane_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2

pytestmark = pytest.mark.timeout(60)

SHAPE = (2, 2, 4, 2, 8)  # (num_layers, 2, block_size, num_kv_heads, head_dim)
LAYOUT = kv_layout_key("tiny", 2, 4, 2, 8, "float32")
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def h(i: int) -> bytes:
    return hashlib.sha256(f"chain-{i}".encode()).digest()


def block(i: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32).reshape(SHAPE) + 1000 * i


def run(body: Callable[[KVStoreServer, KVStoreClient], Awaitable[None]], **cfg: Any) -> None:
    """Run `body` against a fresh in-process server (config overrides in `cfg`) and a client."""

    async def main() -> None:
        config = KVStoreConfig(**{"port": 0, "ram_bytes": 64 * BLOCK_BYTES, **cfg})
        server = await serve(config)
        client = KVStoreClient(server.address, server.data_endpoint, timeout_s=5.0)
        try:
            await asyncio.wait_for(body(server, client), timeout=30)
        finally:
            await client.close()
            await server.stop(grace_s=0.5)

    asyncio.run(main())


def test_put_get_lookup_round_trip_of_tensors() -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        blocks = [block(i) for i in range(4)]
        hashes = [h(i) for i in range(4)]
        assert await client.put(LAYOUT, hashes, [tensor_frame(b) for b in blocks]) == 4
        assert await client.lookup(LAYOUT, hashes + [h(99)]) == 4
        assert await client.lookup(LAYOUT, [h(99), *hashes]) == 0
        frames = await client.get(LAYOUT, hashes[:2] + [h(99)] + hashes[2:])
        assert len(frames) == 2
        for f, b in zip(frames, blocks, strict=False):
            assert torch.equal(frame_tensor(f, torch.float32, SHAPE), b)
        other = kv_layout_key("tiny", 2, 4, 2, 8, "float16")
        assert await client.lookup(other, hashes) == 0
        assert await client.get(other, hashes) == []

    run(body)


def test_concurrent_gets_and_puts_are_matched_to_their_calls() -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        puts = [client.put(LAYOUT, [h(i)], [tensor_frame(block(i))]) for i in range(16)]
        assert await asyncio.gather(*puts) == [1] * 16
        gets = [client.get(LAYOUT, [h(i), h(i + 1)]) for i in range(16)]
        results = await asyncio.gather(*gets)
        for i, frames in enumerate(results):
            assert len(frames) == (2 if i < 15 else 1)
            assert torch.equal(frame_tensor(frames[0], torch.float32, SHAPE), block(i))

    run(body)


def test_malformed_messages_are_answered_and_survived() -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.data_endpoint)

        async def exchange(frames: list[bytes]) -> dataplane_pb2.KVStoreHeader:
            await raw.send_multipart(frames)
            reply_frames = await asyncio.wait_for(raw.recv_multipart(), 5)
            reply = dataplane_pb2.KVStoreHeader()
            reply.ParseFromString(reply_frames[0])
            assert len(reply_frames) == 1 and reply.op == dataplane_pb2.KV_STORE_OP_REPLY
            return reply

        def hdr(**kw: object) -> bytes:
            return dataplane_pb2.KVStoreHeader(**kw).SerializeToString()  # type: ignore[arg-type]

        put, get = dataplane_pb2.KV_STORE_OP_PUT, dataplane_pb2.KV_STORE_OP_GET
        good = bytes(tensor_frame(block(0)))
        cases = {
            "garbage header": [b"\xff\xff\xff\xff not a protobuf"],
            "empty message": [b""],
            "op unspecified": [hdr(seq=7, layout=LAYOUT, block_hashes=[h(0)])],
            "op reply": [hdr(op=dataplane_pb2.KV_STORE_OP_REPLY, seq=8, layout=LAYOUT)],
            "missing frames": [hdr(op=put, seq=9, layout=LAYOUT, block_hashes=[h(0), h(1)]), good],
            "extra frames": [hdr(op=put, seq=10, layout=LAYOUT, block_hashes=[h(0)]), good, good],
            "wrong size": [hdr(op=put, seq=11, layout=LAYOUT, block_hashes=[h(0)]), good[:-4]],
            "unequal sizes": [
                hdr(op=put, seq=12, layout=LAYOUT, block_hashes=[h(0), h(1)]),
                good,
                good + b"\0" * 4,
            ],
            "short hash": [hdr(op=get, seq=13, layout=LAYOUT, block_hashes=[b"abc"])],
            "no layout": [hdr(op=get, seq=14, block_hashes=[h(0)])],
            "bad layout": [hdr(op=put, seq=15, layout="nope", block_hashes=[h(0)]), good],
            "get with frames": [hdr(op=get, seq=16, layout=LAYOUT, block_hashes=[h(0)]), good],
        }
        for name, frames in cases.items():
            reply = await exchange(frames)
            assert reply.error, name
            assert reply.found_count == 0, name
        assert server.data_plane is not None and server.data_plane.num_rejected == len(cases)

        raw.close()
        ctx.term()
        # Nothing was stored, and valid traffic still works.
        assert await client.lookup(LAYOUT, [h(0)]) == 0
        assert await client.put(LAYOUT, [h(0)], [tensor_frame(block(0))]) == 1
        (frame,) = await client.get(LAYOUT, [h(0)])
        assert torch.equal(frame_tensor(frame, torch.float32, SHAPE), block(0))

    run(body)


def test_events_snapshot_and_stats_follow_the_traffic() -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(server.events_endpoint)
        await asyncio.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher first

        frames = [tensor_frame(block(i)) for i in range(6)]
        assert await client.put(LAYOUT, [h(0), h(1), h(2)], frames[:3]) == 3
        assert await client.put(LAYOUT, [h(0)], frames[:1]) == 1  # already held: no event
        # RAM holds 4 blocks: the chain 3, 4, 5 evicts the LRU blocks: chain 0-2's tail 2, 1.
        assert await client.put(LAYOUT, [h(3), h(4), h(5)], frames[3:6]) == 3
        assert len(await client.get(LAYOUT, [h(0), h(1), h(6)])) == 1
        assert await client.lookup(LAYOUT, [h(0), h(3), h(4)]) == 3

        batches = []
        for _ in range(2):
            batch = dataplane_pb2.KVEventBatch()
            batch.ParseFromString(await asyncio.wait_for(sub.recv(), 5))
            batches.append(batch)
        assert [b.seq for b in batches] == [1, 2]
        assert {b.publisher_id for b in batches} == {"kvstore"}
        assert list(batches[0].stored) == [h(2), h(1), h(0)] and not batches[0].removed
        assert sorted(batches[1].stored) == sorted([h(3), h(4), h(5)])
        assert sorted(batches[1].removed) == sorted([h(1), h(2)])
        with pytest.raises(asyncio.TimeoutError):  # nothing else was published
            await asyncio.wait_for(sub.recv(), 0.2)
        sub.close()
        ctx.term()

        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            snap = await stub.GetKVSnapshot(worker_pb2.GetKVSnapshotRequest())
            assert (snap.publisher_id, snap.seq) == ("kvstore", 2)
            held: set[bytes] = set()
            for b in batches:
                held.difference_update(b.removed)
                held.update(b.stored)
            assert set(snap.block_hashes) == held == {h(0), h(3), h(4), h(5)}

            stats = await stub.GetStoreStats(kvstore_pb2.GetStoreStatsRequest())
            (ram,) = stats.tiers
            assert ram.tier == "ram"
            assert (ram.num_blocks, ram.bytes) == (4, 4 * BLOCK_BYTES)
            assert ram.capacity_bytes == 4 * BLOCK_BYTES
            assert (ram.hits, ram.evictions) == (1, 2)
            assert (stats.misses, stats.puts) == (2, 7)

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(kvstore_pb2.LookupRequest(layout=LAYOUT, block_hashes=[b"x"]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "block_hashes[0]" in (err.value.details() or "")

        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
            text = (await asyncio.to_thread(r.read)).decode()
        for line in (
            'llmfleet:kvstore_hits_total{tier="ram"}',
            "llmfleet:kvstore_misses_total ",
            'llmfleet:kvstore_bytes{tier="ram"} 4096.0',
            'llmfleet:kvstore_evictions_total{tier="ram"}',
        ):
            assert line in text, line

    run(body, ram_bytes=4 * BLOCK_BYTES)


def test_disk_tier_through_the_server(tmp_path: Path) -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        hashes = [h(i) for i in range(4)]
        assert await client.put(LAYOUT, hashes, [tensor_frame(block(i)) for i in range(4)]) == 4
        frames = await client.get(LAYOUT, hashes)
        assert [torch.equal(frame_tensor(f, torch.float32, SHAPE), block(i))
                for i, f in enumerate(frames)] == [True] * 4  # fmt: skip
        stats = await client.stats()
        assert [(t.tier, t.num_blocks) for t in stats.tiers] == [("ram", 2), ("disk", 2)]
        assert [t.hits for t in stats.tiers] == [2, 2]

    run(body, ram_bytes=2 * BLOCK_BYTES, disk_dir=str(tmp_path), disk_bytes=8 * BLOCK_BYTES)

    async def after_restart(server: KVStoreServer, client: KVStoreClient) -> None:
        # The blocks that were on disk are announced as event seq 1 and in the snapshot.
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            snap = await stub.GetKVSnapshot(worker_pb2.GetKVSnapshotRequest())
        assert snap.seq == 1 and len(snap.block_hashes) == 2
        assert await client.lookup(LAYOUT, list(snap.block_hashes)[:1]) == 1

    run(after_restart, ram_bytes=2 * BLOCK_BYTES, disk_dir=str(tmp_path))


def test_client_errors_are_typed() -> None:
    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        with pytest.raises(ValidationError, match=r"block_hashes\[1\]"):
            await client.get(LAYOUT, [h(0), b"short"])
        with pytest.raises(ValidationError, match="payloads"):
            await client.put(LAYOUT, [h(0)], [])
        with pytest.raises(KVStoreError, match="needs 1024"):
            await client.put(LAYOUT, [h(0)], [b"\0" * 8])

        # Nothing listens on this endpoint: the call times out as Unavailable.
        ctx = zmq.asyncio.Context()
        probe = ctx.socket(zmq.ROUTER)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
        ctx.term()
        dead = KVStoreClient(server.address, f"tcp://127.0.0.1:{port}", timeout_s=0.2)
        with pytest.raises(Unavailable, match="no reply"):
            await dead.get(LAYOUT, [h(0)])
        await dead.close()
        with pytest.raises(Unavailable, match="closed"):
            await dead.get(LAYOUT, [h(0)])
        with pytest.raises(Unavailable, match="closed"):
            await dead.lookup(LAYOUT, [h(0)])

        # A call in flight when the client closes fails at once, not at its timeout.
        slow = KVStoreClient(server.address, f"tcp://127.0.0.1:{port}", timeout_s=30)
        pending = asyncio.create_task(slow.get(LAYOUT, [h(0)]))
        await asyncio.sleep(0.05)
        await slow.close()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(pending, 1)

        gone = KVStoreClient("127.0.0.1:1", server.data_endpoint, timeout_s=1)
        with pytest.raises(Unavailable, match="Lookup"):
            await gone.lookup(LAYOUT, [h(0)])
        await gone.close()

    run(body)


def test_failed_start_releases_everything() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        taken = ctx.socket(zmq.ROUTER)
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        try:
            with pytest.raises(zmq.ZMQError):
                await asyncio.wait_for(serve(KVStoreConfig(port=0, data_port=port)), 10)
        finally:
            taken.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_the_routers_store_view_follows_the_snapshot_then_the_puts() -> None:
    """The router's view of the store (services/router/store_view.py): the prefix it holds,
    from its snapshot at subscription and its events after, as the routing scorer reads it."""
    from llmfleet.services.router.store_view import StoreView

    async def body(server: KVStoreServer, client: KVStoreClient) -> None:
        hashes = [h(i) for i in range(6)]
        await client.put(LAYOUT, hashes[:2], [tensor_frame(block(i)) for i in range(2)])
        ctx = zmq.asyncio.Context()
        view = StoreView(ctx, server.address, server.events_endpoint)
        view.start()
        try:

            async def until(n: int) -> None:
                for _ in range(500):
                    if view.matched_prefix(hashes) == n:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"the view holds {view.matched_prefix(hashes)}, not {n}")

            await until(2)  # from the snapshot
            more = [tensor_frame(block(i)) for i in range(2, 5)]
            await client.put(LAYOUT, hashes[2:5], more)
            await until(5)  # from the events
            assert view.matched_prefix([h(99), *hashes]) == 0
        finally:
            await view.close()
            ctx.destroy(linger=0)

    run(body)
