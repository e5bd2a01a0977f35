"""The encoder-output cache: bounded in bytes, LRU, and pinned entries are never evicted."""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.encoder_cache import EncoderCache


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # n rows of 16 bytes


def test_lru_eviction_keeps_the_bound():
    cache = EncoderCache(max_bytes=64)
    for h in "abcd":
        cache.put(h, rows(1))
    assert cache.num_bytes == 64 and len(cache) == 4
    assert cache.get("a") is not None  # a becomes the most recently used
    cache.put("e", rows(2))  # 32 more bytes: b and c (least recently used) go
    assert [h for h in "abcde" if h in cache] == ["a", "d", "e"]
    assert cache.num_bytes == 64 and cache.num_evicted == 2


def test_pinned_entries_stay_beyond_the_bound_until_unpinned():
    cache = EncoderCache(max_bytes=32)
    cache.pin("r1", ["x", "y"])
    cache.pin("r2", ["y"])
    cache.put("x", rows(2))
    cache.put("y", rows(2))
    cache.put("z", rows(1))  # unpinned: evicted at once, the pinned ones exceed the bound
    assert "x" in cache and "y" in cache and "z" not in cache
    assert cache.num_bytes == 64
    cache.unpin("r1")  # x is free now; y is still r2's
    assert "x" not in cache and "y" in cache and cache.num_bytes == 32
    assert cache.is_pinned("y") and not cache.is_pinned("x")
    cache.unpin("r2")
    assert cache.num_bytes == 32 and not cache.is_pinned("y")  # within the bound: kept
    cache.unpin("r2")  # nothing left to drop


def test_put_replaces_and_pinning_again_replaces_the_owners_pins():
    cache = EncoderCache(max_bytes=16)
    cache.put("a", rows(4))
    cache.put("a", rows(1))
    assert cache.num_bytes == 16
    cache.pin("r", ["a", "a"])
    cache.pin("r", ["a", "b"])
    cache.put("b", rows(1))  # both pinned: over the bound, nothing evicted
    assert "a" in cache and "b" in cache
    cache.pin("r", ["b"])  # a is no longer pinned: evicted at once
    assert "a" not in cache and cache.is_pinned("b") and cache.num_bytes == 16
    with pytest.raises(ValueError):
        EncoderCache(max_bytes=-1)
