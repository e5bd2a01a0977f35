"""The media store (shared/wire/media.py): LRU by bytes, and real ZMQ round trips of pixels from
a MediaServer to a MediaClient, plaintext and under CURVE."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from llmfleet.cli.tls_init import init_tls_dir
from llmfleet.shared.core.multimodal import PixelInput
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.media import (
    MediaClient,
    MediaNotFoundError,
    MediaServer,
    MediaStore,
    MediaStoreError,
)
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.transport import bind
from llmfleet.v1 import dataplane_pb2

pytestmark = pytest.mark.timeout(60)


def h(i: int) -> str:
    return hashlib.sha256(f"image-{i}".encode()).hexdigest()


def pixels(i: int, rows: int = 4) -> PixelInput:
    """A Qwen2-VL-like (patches, C*T*P*P) tensor with grid, distinct per i."""
    t = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6) + 100 * i
    return PixelInput(t, (1, 2, rows // 2))


def test_store_evicts_least_recently_used_within_its_byte_budget() -> None:
    one = 4 * 6 * 4  # bytes of pixels(i)
    store = MediaStore(capacity_bytes=3 * one)
    for i in range(3):
        assert store.put(h(i), pixels(i))
    assert store.num_bytes == 3 * one
    got, missing = store.get_all([h(0)])  # 0 becomes the most recently used
    assert missing == [] and torch.equal(got[0].pixel_values, pixels(0).pixel_values)
    assert store.put(h(3), pixels(3))  # evicts 1, the least recently used
    assert h(1) not in store and all(h(i) in store for i in (0, 2, 3))
    assert store.num_bytes == 3 * one and store.num_evictions == 1
    assert store.put(h(0), pixels(0))  # already held: no growth
    assert store.num_bytes == 3 * one and len(store) == 3
    assert not store.put(h(9), pixels(9, rows=20))  # larger than the whole budget
    assert h(9) not in store and len(store) == 3
    got, missing = store.get_all([h(2), h(1), h(5)])
    assert got == [] and missing == [h(1), h(5)]
    assert (store.num_hits, store.num_misses) == (1, 2)


def test_store_keeps_a_contiguous_copy_of_a_strided_tensor() -> None:
    store = MediaStore(capacity_bytes=1 << 20)
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    store.put(h(0), PixelInput(t))
    (got,), _ = store.get_all([h(0)])
    assert got.pixel_values.is_contiguous() and torch.equal(got.pixel_values, t)


Body = Callable[[MediaStore, MediaClient, str], Awaitable[None]]


def run(body: Body, *, tls_dir: Path | None = None, capacity: int = 1 << 20) -> list[int]:
    """`body(store, client, endpoint)` against a server on loopback; returns the on_fetch
    counts [hits, misses]."""
    counts = [0, 0]

    def on_fetch(hits: int, misses: int) -> None:
        counts[0] += hits
        counts[1] += misses

    async def main() -> None:
        fleet_tls = tls.load(tls_dir)
        ctx = tls.zmq_context(fleet_tls)
        sock, endpoint = bind(ctx, zmq.ROUTER, "127.0.0.1")
        store = MediaStore(capacity)
        server = MediaServer(sock, store, on_fetch=on_fetch)
        task = asyncio.create_task(server.run())
        client = MediaClient(timeout_s=5.0, tls=fleet_tls)
        try:
            await asyncio.wait_for(body(store, client, endpoint), timeout=30)
        finally:
            await client.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close(linger=0)
            ctx.term()

    asyncio.run(main())
    return counts


def test_fetch_round_trips_pixels_and_grids_over_zmq() -> None:
    async def body(store: MediaStore, client: MediaClient, endpoint: str) -> None:
        for i in range(3):
            store.put(h(i), pixels(i, rows=4 + 2 * i))
        got = await client.fetch(endpoint, [h(2), h(0), h(2)])
        assert list(got) == [h(2), h(0)]
        for i in (0, 2):
            assert torch.equal(got[h(i)].pixel_values, pixels(i, 4 + 2 * i).pixel_values)
            assert got[h(i)].grid == pixels(i, 4 + 2 * i).grid
        # Concurrent fetches are matched to their calls.
        results = await asyncio.gather(*(client.fetch(endpoint, [h(i % 3)]) for i in range(12)))
        for i, r in enumerate(results):
            assert torch.equal(
                r[h(i % 3)].pixel_values, pixels(i % 3, 4 + 2 * (i % 3)).pixel_values
            )

    assert run(body) == [14, 0]


def test_fetch_of_an_evicted_image_names_the_missing_hash() -> None:
    one = 4 * 6 * 4

    async def body(store: MediaStore, client: MediaClient, endpoint: str) -> None:
        store.put(h(0), pixels(0))
        store.put(h(1), pixels(1))
        store.put(h(2), pixels(2))  # evicts 0
        with pytest.raises(MediaNotFoundError) as info:
            await client.fetch(endpoint, [h(1), h(0)])
        assert info.value.content_hash == h(0) and h(0) in str(info.value)
        got = await client.fetch(endpoint, [h(1), h(2)])  # the store still serves
        assert torch.equal(got[h(2)].pixel_values, pixels(2).pixel_values)

    assert run(body, capacity=2 * one) == [2, 1]


def test_malformed_requests_are_rejected_and_the_loop_goes_on() -> None:
    async def body(store: MediaStore, client: MediaClient, endpoint: str) -> None:
        store.put(h(0), pixels(0))
        with pytest.raises(MediaStoreError, match="content_hashes\\[0\\]"):
            await client.fetch(endpoint, ["not-a-hash"])
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(endpoint)
        await raw.send_multipart([b"\xff\xff garbage"])
        reply = dataplane_pb2.MediaReply()
        reply.ParseFromString(await asyncio.wait_for(raw.recv(), 5))
        assert reply.error and not reply.images
        raw.close()
        ctx.term()
        got = await client.fetch(endpoint, [h(0)])
        assert torch.equal(got[h(0)].pixel_values, pixels(0).pixel_values)

    run(body)


def test_a_store_that_does_not_answer_is_unavailable() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock, endpoint = bind(ctx, zmq.ROUTER, "127.0.0.1")  # bound, never read
        client = MediaClient(timeout_s=0.3)
        try:
            with pytest.raises(Unavailable, match="no reply"):
                await client.fetch(endpoint, [h(0)])
        finally:
            await client.close()
            sock.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_fetch_under_curve(tmp_path: Path) -> None:
    init_tls_dir(tmp_path / "tls")

    async def body(store: MediaStore, client: MediaClient, endpoint: str) -> None:
        store.put(h(7), pixels(7))
        got = await client.fetch(endpoint, [h(7)])
        assert torch.equal(got[h(7)].pixel_values, pixels(7).pixel_values)

    assert run(body, tls_dir=tmp_path / "tls") == [1, 0]
