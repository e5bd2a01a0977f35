"""BlockStore core: byte budgets, LRU order, tiers, persistence, prefix semantics, events."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from llmfleet.services.kvstore.disk import layout_dirname
from llmfleet.services.kvstore.store import BlockStore
from llmfleet.shared.core.errors import ValidationError

pytestmark = pytest.mark.timeout(30)

L = "model|L2|B4|H2|D8|float32"
BLOCK = 100  # bytes per test block


def h(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload(i: int, size: int = BLOCK) -> bytes:
    return bytes([i % 256]) * size


def put(store: BlockStore, ids: list[int], layout: str = L, size: int = BLOCK) -> int:
    return store.put(layout, [h(i) for i in ids], [payload(i, size) for i in ids])


def held(store: BlockStore, ids: list[int], layout: str = L) -> list[int]:
    return [i for i in ids if store.lookup(layout, [h(i)]) == 1]


def tier(store: BlockStore, name: str):
    return next(t for t in store.stats().tiers if t.tier == name)


def test_put_get_round_trip_and_stats() -> None:
    store = BlockStore(ram_bytes=10 * BLOCK)
    assert put(store, [0, 1, 2]) == 3
    assert store.get(L, [h(0), h(1), h(2)]) == [payload(0), payload(1), payload(2)]
    ram = tier(store, "ram")
    assert (ram.num_blocks, ram.bytes, ram.capacity_bytes, ram.hits) == (3, 300, 1000, 3)
    assert store.stats().puts == 3 and store.stats().misses == 0
    assert [t.tier for t in store.stats().tiers] == ["ram"]


def test_prefix_semantics_of_get_and_lookup() -> None:
    store = BlockStore(ram_bytes=10 * BLOCK)
    put(store, [0, 1, 3])  # block 2 missing: the chain 0,1,2,3 is held up to 2
    chain = [h(0), h(1), h(2), h(3)]
    assert store.lookup(L, chain) == 2
    assert store.get(L, chain) == [payload(0), payload(1)]
    assert store.get(L, [h(2), h(3)]) == []
    assert store.lookup(L, []) == 0 and store.get(L, []) == []
    stats = store.stats()
    assert stats.misses == 2 + 2  # blocks asked for and not returned
    assert stats.tiers[0].hits == 2


def test_lookup_has_no_side_effects() -> None:
    store = BlockStore(ram_bytes=3 * BLOCK)
    put(store, [0])
    put(store, [1])
    put(store, [2])
    before = store.stats()
    assert store.lookup(L, [h(0)]) == 1  # does not refresh block 0
    assert store.stats() == before
    put(store, [3])
    assert held(store, [0, 1, 2, 3]) == [1, 2, 3]


def test_ram_lru_byte_budget_and_eviction_order() -> None:
    store = BlockStore(ram_bytes=3 * BLOCK)
    for i in range(3):
        put(store, [i])
    assert store.get(L, [h(0)]) == [payload(0)]  # block 0 is now the most recent
    put(store, [3])
    assert held(store, [0, 1, 2, 3]) == [0, 2, 3]  # block 1 was least recently used
    put(store, [4], size=2 * BLOCK)  # needs two blocks' worth of room: 2, then 0 go
    assert held(store, [0, 2, 3, 4]) == [3, 4]
    ram = tier(store, "ram")
    assert ram.bytes == 3 * BLOCK and ram.evictions == 3
    changes = store.drain_changes()
    assert sorted(changes.stored) == sorted([h(3), h(4)])
    assert changes.removed == []  # 0, 1, 2 came and went within this drain...
    store = BlockStore(ram_bytes=3 * BLOCK)
    put(store, [0, 1, 2])
    store.drain_changes()
    put(store, [3])
    assert store.drain_changes().removed == [h(2)]  # ...and one drain later they are "removed"


def test_chain_is_evicted_tail_first() -> None:
    store = BlockStore(ram_bytes=4 * BLOCK)
    put(store, [0, 1, 2, 3])
    put(store, [10, 11])
    assert store.lookup(L, [h(0), h(1), h(2), h(3)]) == 2  # the head survives, not the tail
    store.get(L, [h(10), h(11)])
    put(store, [20])
    assert store.lookup(L, [h(0), h(1)]) == 1
    assert store.lookup(L, [h(10), h(11)]) == 2


def test_put_of_held_block_touches_it() -> None:
    store = BlockStore(ram_bytes=2 * BLOCK)
    put(store, [0])
    put(store, [1])
    assert put(store, [0]) == 1  # already held: refreshed, counted as accepted
    put(store, [2])
    assert held(store, [0, 1, 2]) == [0, 2]
    assert store.stats().puts == 4


def test_oversize_block_is_refused_cleanly() -> None:
    store = BlockStore(ram_bytes=2 * BLOCK)
    put(store, [0])
    assert put(store, [1], size=3 * BLOCK) == 0
    assert held(store, [0, 1]) == [0]
    assert store.stats().puts == 1
    assert store.drain_changes().stored == [h(0)]


def test_layout_isolation() -> None:
    other = "model|L2|B4|H2|D8|bfloat16"
    store = BlockStore(ram_bytes=10 * BLOCK)
    store.put(L, [h(0)], [payload(0)])
    store.put(other, [h(0)], [payload(9)])
    assert store.get(L, [h(0)]) == [payload(0)]
    assert store.get(other, [h(0)]) == [payload(9)]
    assert store.lookup("model|L4|B4|H2|D8|float32", [h(0)]) == 0
    assert store.drain_changes().stored == [h(0)]  # one hash, held under two layouts


def test_hash_removed_only_when_no_layout_holds_it() -> None:
    other = "other"
    store = BlockStore(ram_bytes=2 * BLOCK)
    store.put(L, [h(0)], [payload(0)])
    store.put(other, [h(0)], [payload(0)])
    store.drain_changes()
    put(store, [1])  # evicts (L, h0)
    assert store.drain_changes().removed == []
    put(store, [2])  # evicts (other, h0): the last copy
    assert store.drain_changes().removed == [h(0)]


def test_validation_errors() -> None:
    store = BlockStore(ram_bytes=10 * BLOCK)
    with pytest.raises(ValidationError, match=r"block_hashes\[0\]"):
        store.put(L, [b"short"], [payload(0)])
    with pytest.raises(ValidationError, match="payloads"):
        store.put(L, [h(0), h(1)], [payload(0)])
    with pytest.raises(ValidationError, match="ram_bytes"):
        BlockStore(ram_bytes=0)


def test_memoryview_payloads_are_kept_by_byte_size() -> None:
    import array

    store = BlockStore(ram_bytes=10 * BLOCK)
    words = array.array("I", range(25))  # 100 bytes, item size 4
    assert store.put(L, [h(0)], [memoryview(words)]) == 1
    (got,) = store.get(L, [h(0)])
    assert bytes(got) == words.tobytes()
    assert tier(store, "ram").bytes == 100


def test_demotion_to_disk_and_promotion_to_ram(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=2 * BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    put(store, [0, 1, 2, 3])  # head 0,1 in RAM; tail 2,3 demoted
    assert held(store, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert (tier(store, "ram").num_blocks, tier(store, "disk").num_blocks) == (2, 2)
    assert tier(store, "ram").evictions == 2
    assert store.drain_changes().removed == []  # demotion is not removal
    files = sorted(p.name for p in (tmp_path / layout_dirname(L)).iterdir())
    assert files == sorted([h(2).hex(), h(3).hex()])

    assert store.get(L, [h(0), h(1), h(2), h(3)]) == [payload(i) for i in range(4)]
    assert (tier(store, "ram").hits, tier(store, "disk").hits) == (2, 2)
    # Promotion: the chain's head ends in RAM, 2 and 3 went up and came down again.
    assert (tier(store, "ram").num_blocks, tier(store, "disk").num_blocks) == (2, 2)
    assert held(store, [0, 1, 2, 3]) == [0, 1, 2, 3]

    store.get(L, [h(3)])  # a disk hit moves to RAM, pushing the RAM LRU down
    ram_keys = {k[1] for k in store._ram.blocks}
    assert h(3) in ram_keys


def test_disk_budget_evicts_lru_and_reports_removed(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=2 * BLOCK)
    for i in range(4):
        put(store, [i])
    # RAM: 3; disk: 1, 2 (0 fell off the disk LRU end)
    assert held(store, [0, 1, 2, 3]) == [1, 2, 3]
    disk = tier(store, "disk")
    assert (disk.num_blocks, disk.bytes, disk.evictions) == (2, 2 * BLOCK, 1)
    changes = store.drain_changes()
    assert set(changes.stored) == {h(1), h(2), h(3)} and changes.removed == []
    put(store, [4])
    assert store.drain_changes().removed == [h(1)]
    assert not (tmp_path / layout_dirname(L) / h(1).hex()).exists()


def test_disk_tier_survives_restart_with_lru_order(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    for i in range(5):
        put(store, [i])  # disk: 0..3 (oldest first), RAM: 4 (lost with the process)
    store.get(L, [h(1)])  # promoted; 4 demoted: disk order 0, 2, 3, 4
    del store

    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    assert held(store, list(range(5))) == [0, 2, 3, 4]
    assert set(store.drain_changes().stored) == {h(0), h(2), h(3), h(4)}
    assert store.get(L, [h(3)]) == [payload(3)]
    assert tier(store, "disk").hits == 1
    del store

    # 3 was promoted to RAM (and is gone with that process): disk order 0, 2, 4. A smaller
    # budget at restart evicts the oldest files.
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=2 * BLOCK)
    assert held(store, list(range(5))) == [2, 4]
    assert sorted(store.drain_changes().stored) == sorted([h(2), h(4)])
    assert tier(store, "disk").evictions == 1
    assert len(list((tmp_path / layout_dirname(L)).iterdir())) == 2


def test_restart_ignores_temp_and_foreign_files(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    put(store, [0, 1])
    sub = tmp_path / layout_dirname(L)
    (sub / f".tmp-{h(7).hex()}-1-1").write_bytes(b"torn")
    (sub / "notes.txt").write_text("x")
    (tmp_path / "stray-file").write_text("x")
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    assert held(store, [0, 1, 7]) == [1]
    assert not any(p.name.startswith(".tmp-") for p in sub.iterdir())


def test_odd_layouts_get_safe_directories(tmp_path: Path) -> None:
    layouts = ["..", "a/b|c", "", "x" * 500, "é|L1"]
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=100 * BLOCK)
    for j, layout in enumerate(layouts):
        store.put(layout, [h(j)], [payload(j)])
        store.put(layout, [h(100 + j)], [payload(j)])  # demotes h(j)
    assert all(p.parent == tmp_path for p in tmp_path.iterdir())
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=100 * BLOCK)
    for j, layout in enumerate(layouts):
        assert store.get(layout, [h(j)]) == [payload(j)], layout


def test_vanished_disk_file_ends_the_prefix(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    put(store, [0, 1, 2])  # RAM: 0; disk: 1, 2
    store.drain_changes()
    os.unlink(tmp_path / layout_dirname(L) / h(1).hex())
    assert store.get(L, [h(0), h(1), h(2)]) == [payload(0)]
    assert store.drain_changes().removed == [h(1)]
    assert store.lookup(L, [h(2)]) == 1


def test_touch_on_disk_persists_as_lru_order(tmp_path: Path) -> None:
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=10 * BLOCK)
    for i in range(4):
        put(store, [i])  # disk: 0, 1, 2; RAM: 3
    put(store, [0])  # held on disk: touched there, now the newest file
    store = BlockStore(ram_bytes=BLOCK, disk_dir=tmp_path, disk_bytes=2 * BLOCK)
    assert held(store, list(range(4))) == [0, 2]
