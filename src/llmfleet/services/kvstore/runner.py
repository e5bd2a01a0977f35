"""The BlockStore as the async server sees it: one thread for every store call, then events and
metrics.

Every call runs on a single worker thread (the store is not thread-safe, and disk reads and
writes must not stall the event loop), one at a time, in the order the loop submits them. After
a call that may change what the store holds, the net change is published as one `KVEventBatch`
before the call returns, so a reply a client sees is never ahead of the events.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import prometheus_client

from llmfleet.services.kvstore.store import BlockStore, Changes, Payload, StoreStats
from llmfleet.shared.wire.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Module-level: the default registry allows one metric per name per process (tests may run
# several stores in one process; their counts add up).
HITS = prometheus_client.Counter(
    "llmfleet:kvstore_hits_total", "Blocks served by a get, per tier", ["tier"]
)
MISSES = prometheus_client.Counter(
    "llmfleet:kvstore_misses_total", "Blocks a get asked for and did not get"
)
BYTES = prometheus_client.Gauge("llmfleet:kvstore_bytes", "Bytes held, per tier", ["tier"])
EVICTIONS = prometheus_client.Counter(
    "llmfleet:kvstore_evictions_total", "Blocks evicted by the byte budget, per tier", ["tier"]
)
BLOCKS = prometheus_client.Gauge("llmfleet:kvstore_blocks", "Blocks held, per tier", ["tier"])
# Payload bytes through the data plane: op "put" (received from workers, new or not) and
# "get" (served to workers).
TRANSFER_BYTES = prometheus_client.Counter(
    "llmfleet:kvstore_transfer_bytes_total", "KV payload bytes put and served", ["op"]
)


class StoreRunner:
    """Owns a BlockStore, its thread and its event publisher (see the module docstring)."""

    def __init__(self, store: BlockStore, publisher: KVEventPublisher) -> None:
        self.store = store
        self.publisher = publisher
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore")
        self._seen = store.stats()
        self._publish_lock = asyncio.Lock()
        self._sync_metrics(self._seen)

    async def start(self) -> None:
        """Announce what the store already holds (blocks found on disk at start)."""
        await self._call_and_publish(lambda: None)

    async def put(self, layout: str, hashes: Sequence[bytes], payloads: Sequence[Payload]) -> int:
        stored = await self._call_and_publish(
            functools.partial(self.store.put, layout, hashes, payloads)
        )
        TRANSFER_BYTES.labels("put").inc(sum(len(p) for p in payloads))
        return stored

    async def get(self, layout: str, hashes: Sequence[bytes]) -> list[Payload]:
        got = await self._call_and_publish(functools.partial(self.store.get, layout, hashes))
        TRANSFER_BYTES.labels("get").inc(sum(len(p) for p in got))
        return got

    async def lookup(self, layout: str, hashes: Sequence[bytes]) -> int:
        return await self._call(functools.partial(self.store.lookup, layout, hashes))

    async def stats(self) -> StoreStats:
        return await self._call(self.store.stats)

    def close(self) -> None:
        """Wait for the call in progress (a disk write finishes whole), then stop the thread."""
        self._executor.shutdown(wait=True)

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _call_and_publish(self, fn: Callable[[], T]) -> T:
        def run() -> tuple[T, Changes, StoreStats]:
            return fn(), self.store.drain_changes(), self.store.stats()

        # The lock keeps event batches (and counter deltas) in the order of the calls.
        async with self._publish_lock:
            result, changes, stats = await self._call(run)
            await self.publisher.publish(stored=changes.stored, removed=changes.removed)
            self._sync_metrics(stats)
        return result

    def _sync_metrics(self, stats: StoreStats) -> None:
        before = {t.tier: t for t in self._seen.tiers}
        for t in stats.tiers:
            prev = before.get(t.tier, t)
            HITS.labels(t.tier).inc(t.hits - prev.hits)
            EVICTIONS.labels(t.tier).inc(t.evictions - prev.evictions)
            BYTES.labels(t.tier).set(t.bytes)
            BLOCKS.labels(t.tier).set(t.num_blocks)
        MISSES.inc(stats.misses - self._seen.misses)
        self._seen = stats
