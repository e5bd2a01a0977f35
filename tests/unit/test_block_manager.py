"""Block manager: allocation, sharing, prefix cache, LRU eviction, free-count invariants."""

from __future__ import annotations

import pytest

from llmfleet.engine.block_manager import BlockManager, FreeBlockQueue, KVBlock
from llmfleet.engine.request import Request
from llmfleet.shared.core.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), frozenset(), BS)


def compute_all(bm: BlockManager, r: Request) -> None:
    """Admit r with its prefix hit, allocate the rest and mark it computed (no model)."""
    hits = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, r.num_tokens, hits)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def test_free_queue_is_doubly_linked_and_o1():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.ids() == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert q.ids() == [2, 1, 3, 4, 0]
    with pytest.raises(ValueError):
        q.remove(KVBlock(99))


def test_allocate_and_free_restore_free_count():
    bm = BlockManager(10, BS)
    r = req("a", list(range(10)))  # 3 blocks
    assert bm.allocate_slots(r, 10)
    assert bm.num_free_blocks == 7
    assert bm.allocate_slots(r, 13)  # grows to 4 blocks
    assert len(bm.block_ids("a")) == 4
    bm.free(r)
    bm.free(r)  # idempotent
    assert bm.num_free_blocks == 10


def test_allocation_fails_without_side_effects():
    bm = BlockManager(3, BS)
    r = req("a", list(range(20)))
    assert not bm.allocate_slots(r, 20)
    assert bm.num_free_blocks == 3 and bm.block_ids("a") == []


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(16, BS)
    a = req("a", list(range(13)))  # 3 full blocks + 1 token
    compute_all(bm, a)
    b = req("b", list(range(12)) + [777, 778])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 3  # 12 cached tokens
    assert bm.allocate_slots(b, b.num_tokens, hits)
    assert bm.block_ids("b")[:3] == bm.block_ids("a")[:3]
    assert bm.block_ids("b")[3] != bm.block_ids("a")[3]
    assert bm.stats.num_hits >= 12
    shared = bm.blocks[bm.block_ids("a")[0]]
    assert shared.ref_cnt == 2
    free_before = bm.num_free_blocks
    bm.free(a)
    assert shared.ref_cnt == 1
    assert bm.num_free_blocks == free_before + 1  # only a's private last block came back
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_full_hit_leaves_one_token_to_compute():
    bm = BlockManager(8, BS)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free(a)
    b = req("b", list(range(8)))
    assert len(bm.get_computed_blocks(b)) == 1  # not 2: the last token must run for logits


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, BS)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # Revive: a new request with the same prefix takes the cached blocks back.
    b = req("b", list(range(8)) + [1])
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == bm.block_ids("a") or len(hits) == 2
    assert bm.allocate_slots(b, 9, hits)
    assert bm.num_free_blocks == 1
    bm.free(b)
    # A request needing every block evicts the cached content.
    c = req("c", [500 + i for i in range(16)])
    assert bm.allocate_slots(c, 16)
    assert bm.cached == {}


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(6, BS)
    old = req("old", [1] * 4)
    new = req("new", [2] * 4)
    compute_all(bm, old)
    compute_all(bm, new)
    bm.free(old)
    bm.free(new)
    # Four uncached free blocks go first, then the older cached one.
    filler = req("filler", list(range(100, 120)))  # 5 blocks
    assert bm.allocate_slots(filler, 20)
    assert len(bm.get_computed_blocks(req("q1", [1] * 4 + [9]))) == 0
    assert len(bm.get_computed_blocks(req("q2", [2] * 4 + [9]))) == 1


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    assert bm.cached == {} and bm.get_computed_blocks(req("b", list(range(9)))) == []


def test_blocks_filled_while_decoding_are_registered():
    bm = BlockManager(16, BS)
    a = req("a", list(range(6)))
    compute_all(bm, a)  # 1 full block registered
    for t in range(6, 13):  # decode token by token, growing the table as the engine does
        a.append_output(t, None)
        assert bm.allocate_slots(a, a.num_tokens)
        a.num_computed_tokens = a.num_tokens
        bm.cache_full_blocks(a)
    assert len(bm.cached) == 3  # tokens 0..11 fill three blocks
    b = req("b", list(range(13)) + [99])
    assert len(bm.get_computed_blocks(b)) == 3


def test_held_cached_blocks_are_not_evicted_until_let_go():
    bm = BlockManager(4, BS)
    a = req("a", list(range(8)))
    compute_all(bm, a)
    bm.free(a)
    hashes = list(bm.cached)
    ids = bm.hold_cached("export", hashes)
    assert ids is not None and sorted(ids) == sorted(b.block_id for b in bm.cached.values())
    assert bm.num_free_blocks == 2
    # A request that needs every block cannot take the held ones.
    assert not bm.allocate_slots(req("big", list(range(100, 116))), 16)
    assert bm.allocate_slots(req("small", list(range(100, 108))), 8)
    assert set(bm.cached) >= set(hashes)
    bm.free_owner("export")
    assert bm.num_free_blocks == 2  # the small request holds the other two
    with pytest.raises(ValueError):
        bm.hold_cached("small", hashes)  # an owner holds one table
    assert bm.hold_cached("x", [b"\0" * 32]) is None and "x" not in bm.req_blocks


def test_an_import_never_evicts_the_cached_prefix_it_extends():
    """A kvstore fetch imports a chain whose head is cached here: taking blocks for its tail
    must not evict that head (the LRU free blocks), or the fetch loses what it extends."""
    bm = BlockManager(8, BS)
    a = req("a", list(range(12)))  # 3 full blocks, then freed: cached, LRU first
    compute_all(bm, a)
    bm.free(a)
    chain = req("c", list(range(24))).block_hashes  # a's 3 blocks and 3 more
    assert bm.num_cached_prefix(chain) == 3
    placed = bm.import_blocks(chain)
    assert [i for i, _ in placed] == [3, 4, 5]
    assert bm.num_cached_prefix(chain) == 6  # the head survived its tail's import
    # With room for only part of the tail, it imports that part and still keeps the head.
    bm2 = BlockManager(5, BS)
    b = req("b", list(range(12)))
    compute_all(bm2, b)
    bm2.free(b)
    assert [i for i, _ in bm2.import_blocks(chain)] == [3, 4]
    assert bm2.num_cached_prefix(chain) == 5


def test_a_cache_of_tens_of_millions_of_blocks_starts_at_once_and_hands_out_every_block():
    """Never-used blocks are created as the free queue reaches them: construction is O(1)."""
    bm = BlockManager(50_000_000, BS)
    assert bm.num_free_blocks == 50_000_000
    r = req("a", list(range(10)))
    assert bm.allocate_slots(r, 10) and bm.block_ids("a") == [0, 1, 2]
    bm.free(r)  # no cached content: back to the front, ahead of the never-used blocks
    assert bm.num_free_blocks == 50_000_000
    b = req("b", list(range(100, 114)))
    assert bm.allocate_slots(b, 14) and sorted(bm.block_ids("b")) == [0, 1, 2, 3]
    assert len(bm.blocks) == 4  # objects made: those taken


def test_fresh_blocks_run_out_in_order_then_the_queue_is_all_objects():
    q = FreeBlockQueue([KVBlock(9)], fresh=range(3))
    assert len(q) == 4 and q.ids() == [0, 1, 2, 9]
    taken = [q.popleft() for _ in range(4)]
    assert [b.block_id for b in taken] == [0, 1, 2, 9] and len(q) == 0
    assert [b.block_id for b in q.made] == [0, 1, 2]
    with pytest.raises(IndexError):
        q.popleft()
    q.append(taken[1])
    assert q.ids() == [1] and q.popleft() is taken[1]
