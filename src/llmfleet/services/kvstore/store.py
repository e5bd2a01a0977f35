"""Content-addressed KV block store: a RAM tier and an optional disk tier, each LRU by bytes.

A block is keyed by (layout key, 32-byte block hash) and is one opaque payload: the KV of one
block for every layer, shape (num_layers, 2, block_size, num_kv_heads, head_dim), as produced by
`shared.wire.transport.tensor_frame`. The store never looks inside a payload.

Tiers are exclusive: a block lives in RAM or on disk, never both.

    put ──► RAM (LRU, ram_bytes) ──evict──► disk (LRU, disk_bytes) ──evict──► gone
              ▲                                │
              └──────── get hit: promote ──────┘

Recency. `put` and `get` touch the blocks of a chain tail first, so the chain's first block
ends up most recently used: eviction eats chains from their tail and never leaves a held suffix
whose prefix is gone (the same order vLLM's free queue keeps). `lookup` has no side effects at
all: it does not touch LRU order or count hits or misses (a worker looks up, then gets; the get
is what counts).

Events. The store tracks which hashes it holds in any tier under any layout. A hash becomes
"stored" when its first copy arrives and "removed" when its last copy leaves every tier; moving
between tiers is neither. `drain_changes()` returns the net change since the previous drain
(a hash stored and removed within one drain appears in neither list).

Counters: hits per tier (blocks a get returned from that tier), misses (blocks a get asked for
and did not return), puts (blocks a put accepted, new or already held), evictions per tier
(blocks pushed out of that tier by its byte budget, demotions included).

Plain Python, no grpc/zmq; not thread-safe: the server calls it from one thread.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llmfleet.services.kvstore.disk import DiskTier, Key
from llmfleet.shared.core.errors import ValidationError

logger = logging.getLogger(__name__)

HASH_BYTES = 32
Payload = bytes | memoryview  # len() == size in bytes (memoryviews are kept as format "B")


@dataclass(frozen=True)
class TierStats:
    tier: str  # "ram" or "disk"
    num_blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    evictions: int


@dataclass(frozen=True)
class StoreStats:
    tiers: tuple[TierStats, ...]  # RAM first, then disk when configured
    misses: int
    puts: int


@dataclass(frozen=True)
class Changes:
    """Net change of the set of held hashes since the previous drain."""

    stored: list[bytes]
    removed: list[bytes]


class _RamTier:
    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[Key, Payload] = OrderedDict()  # LRU first
        self.bytes = 0
        self.hits = 0
        self.evictions = 0

    def add(self, key: Key, payload: Payload) -> None:
        self.blocks[key] = payload
        self.bytes += len(payload)

    def pop(self, key: Key) -> Payload:
        payload = self.blocks.pop(key)
        self.bytes -= len(payload)
        return payload


class BlockStore:
    """See the module docstring for tiers, recency, events and counters."""

    def __init__(
        self,
        ram_bytes: int,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 8 << 30,
    ) -> None:
        if ram_bytes < 1:
            raise ValidationError("ram_bytes", f"must be >= 1, got {ram_bytes}")
        if disk_dir is not None and disk_bytes < 1:
            raise ValidationError("disk_bytes", f"must be >= 1, got {disk_bytes}")
        self._ram = _RamTier(ram_bytes)
        self._disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        self._holders: dict[bytes, int] = {}  # hash -> number of layouts holding it
        self._pending: dict[bytes, bool] = {}  # hash -> True stored / False removed, undrained
        self._misses = 0
        self._puts = 0
        if self._disk is not None:
            self._load_disk(self._disk)

    def _load_disk(self, disk: DiskTier) -> None:
        keys = disk.scan()
        for key in keys:
            self._gained(key)
        while disk.bytes > disk.capacity_bytes:  # the budget shrank since the last run
            self._evict_disk_lru(disk)
        logger.info("kvstore disk tier %s: %d blocks, %d bytes", disk.root, len(disk), disk.bytes)

    # ---- public API -------------------------------------------------------------------------

    def put(self, layout: str, hashes: Sequence[bytes], payloads: Sequence[Payload]) -> int:
        """Store blocks; returns how many of them the store holds afterwards.

        A block already held is only touched (content addressing: same hash, same bytes). A
        block larger than the RAM budget is refused (not stored, not counted).
        """
        _check_hashes(hashes)
        if len(payloads) != len(hashes):
            raise ValidationError(
                "payloads", f"{len(payloads)} payloads for {len(hashes)} block hashes"
            )
        views = [_as_payload(p, i) for i, p in enumerate(payloads)]
        for i in reversed(range(len(hashes))):
            key = (layout, bytes(hashes[i]))
            if key in self._ram.blocks:
                self._ram.blocks.move_to_end(key)
            elif self._disk is not None and key in self._disk:
                self._disk.touch(key)
            elif len(views[i]) > self._ram.capacity_bytes:
                logger.warning("kvstore: refused a %d-byte block (RAM budget %d bytes)",
                               len(views[i]), self._ram.capacity_bytes)  # fmt: skip
                continue
            else:
                self._insert_ram(key, views[i])
                self._gained(key)
            self._puts += 1
        return sum(1 for h in hashes if self._holds((layout, bytes(h))))

    def get(self, layout: str, hashes: Sequence[bytes]) -> list[Payload]:
        """The payloads of the longest held prefix of the chain `hashes`, in order."""
        _check_hashes(hashes)
        keys = [(layout, bytes(h)) for h in hashes[: self.lookup(layout, hashes)]]
        out: list[Payload] = []
        for key in keys:
            payload = self._ram.blocks.get(key)
            if payload is not None:
                self._ram.hits += 1
            else:
                disk = self._disk
                payload = disk.read(key) if disk is not None else None
                if payload is None:  # its file vanished: the chain is held only up to here
                    self._lost(key)
                    break
                disk.hits += 1  # type: ignore[union-attr]
            out.append(payload)
        self._misses += len(hashes) - len(out)
        self._refresh(keys[: len(out)], out)
        return out

    def lookup(self, layout: str, hashes: Sequence[bytes]) -> int:
        """Length of the longest held prefix of the chain. No side effects."""
        n = 0
        for h in hashes:
            if not self._holds((layout, bytes(h))):
                break
            n += 1
        return n

    def drain_changes(self) -> Changes:
        stored = [h for h, s in self._pending.items() if s]
        removed = [h for h, s in self._pending.items() if not s]
        self._pending.clear()
        return Changes(stored=stored, removed=removed)

    def held_hashes(self) -> list[bytes]:
        """Every distinct hash held in any tier under any layout."""
        return list(self._holders)

    def stats(self) -> StoreStats:
        tiers = [_tier_stats(self._ram, len(self._ram.blocks))]
        if self._disk is not None:
            tiers.append(_tier_stats(self._disk, len(self._disk)))
        return StoreStats(tiers=tuple(tiers), misses=self._misses, puts=self._puts)

    def __len__(self) -> int:
        return len(self._ram.blocks) + (len(self._disk) if self._disk is not None else 0)

    # ---- tiers ------------------------------------------------------------------------------

    def _holds(self, key: Key) -> bool:
        return key in self._ram.blocks or (self._disk is not None and key in self._disk)

    def _refresh(self, keys: list[Key], payloads: list[Payload]) -> None:
        """After a get: make the chain most recently used, head last; promote disk hits."""
        disk = self._disk
        if disk is not None:
            # First make the chain's disk blocks the newest on disk, so that the demotions the
            # promotions below cause evict other blocks, not the rest of this chain.
            for key in reversed(keys):
                if key in disk:
                    disk.touch(key)
        for key, payload in zip(reversed(keys), reversed(payloads), strict=True):
            if key in self._ram.blocks:
                self._ram.blocks.move_to_end(key)
            elif disk is not None and key in disk and len(payload) <= self._ram.capacity_bytes:
                disk.delete(key)
                self._insert_ram(key, payload)

    def _insert_ram(self, key: Key, payload: Payload) -> None:
        ram = self._ram
        while ram.bytes + len(payload) > ram.capacity_bytes:
            old_key, old_payload = ram.blocks.popitem(last=False)
            ram.bytes -= len(old_payload)
            ram.evictions += 1
            self._demote(old_key, old_payload)
        ram.add(key, payload)

    def _demote(self, key: Key, payload: Payload) -> None:
        disk = self._disk
        if disk is None or len(payload) > disk.capacity_bytes:
            self._lost(key)
            return
        while disk.bytes + len(payload) > disk.capacity_bytes:
            self._evict_disk_lru(disk)
        if not disk.write(key, payload):
            self._lost(key)

    def _evict_disk_lru(self, disk: DiskTier) -> None:
        key = disk.lru()
        disk.delete(key)
        disk.evictions += 1
        self._lost(key)

    # ---- held-hash accounting ---------------------------------------------------------------

    def _gained(self, key: Key) -> None:
        h = key[1]
        n = self._holders.get(h, 0)
        self._holders[h] = n + 1
        if n == 0:
            self._note(h, stored=True)

    def _lost(self, key: Key) -> None:
        h = key[1]
        n = self._holders[h] - 1
        if n:
            self._holders[h] = n
            return
        del self._holders[h]
        self._note(h, stored=False)

    def _note(self, h: bytes, *, stored: bool) -> None:
        if self._pending.get(h, stored) != stored:
            del self._pending[h]  # the opposite change is still undrained: they cancel
        else:
            self._pending[h] = stored


def _check_hashes(hashes: Sequence[bytes]) -> None:
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise ValidationError(f"block_hashes[{i}]", f"must be {HASH_BYTES} bytes, got {len(h)}")


def _as_payload(p: bytes | bytearray | memoryview, i: int) -> Payload:
    if isinstance(p, bytes):
        return p
    try:
        view = memoryview(p)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError as e:
        raise ValidationError(f"payloads[{i}]", f"not a contiguous buffer: {e}") from None


def _tier_stats(tier: _RamTier | DiskTier, num_blocks: int) -> TierStats:
    return TierStats(
        tier=tier.name,
        num_blocks=num_blocks,
        bytes=tier.bytes,
        capacity_bytes=tier.capacity_bytes,
        hits=tier.hits,
        evictions=tier.evictions,
    )
