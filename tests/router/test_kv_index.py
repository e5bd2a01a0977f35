"""KV index: consecutive events apply; gaps, first contact and a restarted publisher (another
epoch) resync by snapshot."""

from __future__ import annotations

from llmfleet.shared.core.kv_index import KVEvents, KVIndex, KVSnapshot

H = [bytes([i]) * 32 for i in range(10)]


def _index() -> tuple[KVIndex, list[str]]:
    asked: list[str] = []
    return KVIndex(asked.append), asked


def _synced(idx: KVIndex, pub: str = "w", seq: int = 0, hashes=(), epoch: int = 0) -> None:
    idx.add_publisher(pub)
    idx.apply_snapshot(KVSnapshot(pub, seq, tuple(hashes), epoch=epoch))


def test_first_contact_is_stale_until_snapshot():
    idx, asked = _index()
    idx.add_publisher("w")
    assert asked == ["w"] and idx.is_stale("w")
    idx.apply(KVEvents("w", 3, stored=(H[0],)))  # buffered while stale
    assert idx.matched_prefix("w", H[:1]) == 0
    idx.apply_snapshot(KVSnapshot("w", 2, (H[1],)))
    assert not idx.is_stale("w")
    assert idx.matched_prefix("w", [H[1], H[0]]) == 2  # snapshot + buffered seq 3
    assert asked == ["w"]


def test_num_blocks_is_unknown_while_stale():
    idx, _ = _index()
    idx.add_publisher("w")
    assert idx.num_blocks("w") is None and idx.num_blocks("nobody") is None
    idx.apply_snapshot(KVSnapshot("w", 1, (H[0], H[1])))
    idx.apply(KVEvents("w", 2, stored=(H[2],), removed=(H[0],)))
    assert idx.num_blocks("w") == 2
    idx.apply(KVEvents("w", 4, stored=(H[3],)))  # a gap: stale until the next snapshot
    assert idx.num_blocks("w") is None


def test_consecutive_events_apply_and_prefix_stops_at_first_miss():
    idx, asked = _index()
    _synced(idx)
    idx.apply(KVEvents("w", 1, stored=(H[0], H[1], H[2])))
    idx.apply(KVEvents("w", 2, removed=(H[1],)))
    assert idx.matched_prefix("w", H[:3]) == 1
    idx.apply(KVEvents("w", 3, stored=(H[5],), cleared=True))
    assert idx.matched_prefix("w", H[:3]) == 0 and idx.matched_prefix("w", [H[5]]) == 1
    assert asked == ["w"]


def test_gap_requests_snapshot_once_and_replays_newer_events():
    idx, asked = _index()
    _synced(idx)
    idx.apply(KVEvents("w", 1, stored=(H[0],)))
    idx.apply(KVEvents("w", 3, stored=(H[2],)))  # seq 2 lost
    assert idx.is_stale("w") and asked == ["w", "w"]
    idx.apply(KVEvents("w", 4, stored=(H[3],)))
    assert asked == ["w", "w"]  # one request per resync
    assert idx.matched_prefix("w", H[:1]) == 0  # stale: scores 0
    idx.apply_snapshot(KVSnapshot("w", 3, (H[0], H[1], H[2])))
    assert idx.matched_prefix("w", H[:4]) == 4
    idx.apply(KVEvents("w", 3, stored=(H[9],)))  # old: already in the snapshot
    assert idx.matched_prefix("w", [H[9]]) == 0


def test_snapshot_older_than_buffer_gap_resyncs_again():
    idx, asked = _index()
    idx.add_publisher("w")
    idx.apply(KVEvents("w", 8, stored=(H[0],)))
    idx.apply_snapshot(KVSnapshot("w", 5, ()))  # 6 and 7 missing
    assert idx.is_stale("w") and asked == ["w", "w"]
    idx.apply_snapshot(KVSnapshot("w", 8, (H[0],)))
    assert idx.matched_prefix("w", H[:1]) == 1


def test_failed_snapshot_is_requested_again_on_next_event():
    idx, asked = _index()
    idx.add_publisher("w")
    idx.snapshot_failed("w")
    idx.apply(KVEvents("w", 1, stored=(H[0],)))
    assert asked == ["w", "w"]


def test_publishers_are_independent_and_removable():
    idx, _ = _index()
    _synced(idx, "a", 0)
    _synced(idx, "b", 0)
    idx.apply(KVEvents("a", 1, stored=(H[0],)))
    assert idx.matched_prefix("a", H[:1]) == 1 and idx.matched_prefix("b", H[:1]) == 0
    idx.remove_publisher("a")
    assert idx.matched_prefix("a", H[:1]) == 0 and idx.publishers() == ["b"]


A, B = 0xA, 0xB  # two runs (epochs) of one publisher


def test_restarted_publisher_resyncs_instead_of_dropping_its_new_events():
    idx, asked = _index()
    _synced(idx, epoch=A)
    for seq in (1, 2, 3):
        idx.apply(KVEvents("w", seq, stored=(H[seq],), epoch=A))
    assert idx.matched_prefix("w", H[1:4]) == 3 and asked == ["w"]
    # The publisher restarts empty: its seq begins again from 1 (<= 3, dropped without epochs).
    idx.apply(KVEvents("w", 1, stored=(H[7],), epoch=B))
    assert idx.is_stale("w") and idx.matched_prefix("w", H[1:4]) == 0
    idx.apply(KVEvents("w", 2, stored=(H[8],), epoch=B))
    assert asked == ["w", "w"]  # one request per resync
    idx.apply_snapshot(KVSnapshot("w", 1, (H[7],), epoch=B))
    assert not idx.is_stale("w") and idx.num_blocks("w") == 2  # snapshot + buffered seq 2
    assert idx.matched_prefix("w", [H[7], H[8]]) == 2 and idx.matched_prefix("w", H[1:2]) == 0
    idx.apply(KVEvents("w", 3, removed=(H[7],), epoch=B))
    assert idx.matched_prefix("w", [H[8]]) == 1 and idx.num_blocks("w") == 1
    assert asked == ["w", "w"]


def test_late_events_of_the_old_run_never_reach_the_new_runs_set():
    idx, asked = _index()
    _synced(idx, seq=5, hashes=(H[0],), epoch=A)
    idx.apply(KVEvents("w", 1, stored=(H[1],), epoch=B))  # restarted
    idx.apply(KVEvents("w", 6, stored=(H[9],), epoch=A))  # the old run's last, delivered late
    idx.apply(KVEvents("w", 2, stored=(H[2],), epoch=B))
    idx.apply_snapshot(KVSnapshot("w", 1, (H[1],), epoch=B))  # replays B's seq 2 only
    assert idx.matched_prefix("w", [H[1], H[2]]) == 2 and idx.num_blocks("w") == 2
    assert asked == ["w", "w"]
    # Later still, once synced to B: never applied (B's snapshot is the truth), a resync.
    idx.apply(KVEvents("w", 7, stored=(H[9],), epoch=A))
    assert idx.matched_prefix("w", [H[9]]) == 0 and asked == ["w"] * 3
    idx.apply(KVEvents("w", 3, removed=(H[1],), epoch=B))
    idx.apply_snapshot(KVSnapshot("w", 2, (H[1], H[2]), epoch=B))
    assert idx.matched_prefix("w", [H[2]]) == 1 and idx.num_blocks("w") == 1
    assert idx.matched_prefix("w", [H[9]]) == 0 and idx.matched_prefix("w", [H[0]]) == 0
