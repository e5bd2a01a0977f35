"""The Responses API's store: its bounds (entries, bytes, TTL) and what each evicts."""

from __future__ import annotations

import json

import pytest

from llmfleet.services.gateway.responses_store import ResponseStore
from llmfleet.shared.core.errors import ValidationError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _response(i: int, text: str = "hi") -> tuple[dict, list[dict]]:
    return {"id": f"resp_{i}", "output_text": text}, [{"role": "user", "content": text}]


def _size(i: int, text: str = "hi") -> int:
    return len(json.dumps(list(_response(i, text)), separators=(",", ":")).encode())


def test_get_returns_what_was_put_and_delete_removes_it():
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=60)
    assert store.put("resp_1", *_response(1))
    entry = store.get("resp_1")
    assert entry is not None and entry.response["id"] == "resp_1"
    assert entry.conversation == [{"role": "user", "content": "hi"}]
    assert store.num_bytes == _size(1) and len(store) == 1
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None and store.num_bytes == 0


def test_the_oldest_leave_when_the_entry_bound_is_reached():
    store = ResponseStore(max_entries=3, max_bytes=10_000, ttl_s=60)
    for i in range(5):
        store.put(f"resp_{i}", *_response(i))
    assert len(store) == 3
    kept = [i for i in range(5) if store.get(f"resp_{i}") is not None]
    assert kept == [2, 3, 4]
    assert store.num_bytes == sum(_size(i) for i in range(2, 5))


def test_the_oldest_leave_when_the_byte_bound_is_reached():
    size = _size(0, "x" * 100)
    store = ResponseStore(max_entries=100, max_bytes=2 * size + size // 2, ttl_s=60)
    for i in range(4):
        assert store.put(f"resp_{i}", *_response(i, "x" * 100))
        assert store.num_bytes <= store.max_bytes
    assert [i for i in range(4) if store.get(f"resp_{i}") is not None] == [2, 3]
    # One entry larger than the whole bound is not stored, and evicts nothing.
    assert not store.put("resp_big", *_response(9, "x" * 1000))
    assert store.get("resp_big") is None and len(store) == 2


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=30, clock=clock)
    store.put("resp_a", *_response(1))
    clock.now += 20
    store.put("resp_b", *_response(2))
    clock.now += 10  # resp_a is 30 s old: gone; resp_b has 20 s left
    assert store.get("resp_a") is None
    assert store.get("resp_b") is not None
    assert store.num_bytes == _size(2)
    clock.now += 20
    assert store.get("resp_b") is None and len(store) == 0 and store.num_bytes == 0


def test_replacing_an_id_counts_its_bytes_once():
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=60)
    store.put("resp_1", *_response(1, "a"))
    store.put("resp_1", *_response(1, "bbbb"))
    assert len(store) == 1 and store.num_bytes == _size(1, "bbbb")
    assert store.get("resp_1").response["output_text"] == "bbbb"


def test_zero_entries_keeps_nothing_and_bad_bounds_are_rejected():
    store = ResponseStore(max_entries=0, max_bytes=10_000, ttl_s=60)
    assert not store.put("resp_1", *_response(1)) and store.get("resp_1") is None
    with pytest.raises(ValidationError, match="responses_store_ttl_s"):
        ResponseStore(max_entries=1, max_bytes=1, ttl_s=0)
    with pytest.raises(ValidationError, match="responses_store_max_entries"):
        ResponseStore(max_entries=-1, max_bytes=1, ttl_s=1)
