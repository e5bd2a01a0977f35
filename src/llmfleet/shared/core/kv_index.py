"""Which block hashes each KV-event publisher holds: the prefix-aware router's view of the
workers, and a worker's view of the kvstore.

Pure Python. The subscriber converts each `KVEventBatch` into `KVEvents` and calls `apply`;
snapshots (`GetKVSnapshot`) arrive as `KVSnapshot` through `apply_snapshot`.

Per publisher, a small state machine. Seq numbers are consecutive from 1 within an epoch: a
random id the publisher picks when it starts, so a restarted publisher (seq from 1 again) is
told apart from old events. The index learns a publisher's epoch from the snapshot it synced
from; epoch 0 (a peer that predates epochs) on both sides never differs.

    SYNCED  --event of another epoch-->  restarted: STALE, buffer it, request a snapshot
    SYNCED  --event seq == last+1----->  apply, SYNCED
    SYNCED  --event seq >  last+1----->  gap: STALE, buffer it, request a snapshot
    SYNCED  --event seq <= last------->  already reflected (e.g. by a snapshot): drop
    STALE   --event------------------->  buffer it (a snapshot is on its way)
    STALE   --snapshot(epoch E, seq S)->  adopt E, replace the set, replay buffered events of
                                         epoch E with seq > S (other runs' are dropped);
                                         consecutive -> SYNCED, another gap -> request again

A publisher is STALE from first contact (`add_publisher`) until its first snapshot, and its
prefix score is 0 while STALE: a router never uses a view it knows to be stale.
`request_snapshot(publisher_id)` is called at most once per resync until the snapshot (or
`snapshot_failed`) arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Events buffered per stale publisher before the oldest are dropped (a snapshot re-covers them).
_MAX_BUFFERED = 4096


@dataclass(frozen=True)
class KVEvents:
    publisher_id: str
    seq: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False
    epoch: int = 0  # the publisher's run: `seq` counts from 1 within it


@dataclass(frozen=True)
class KVSnapshot:
    publisher_id: str
    seq: int
    block_hashes: tuple[bytes, ...] = ()
    epoch: int = 0


@dataclass
class _Publisher:
    hashes: set[bytes] = field(default_factory=set)
    epoch: int = 0  # of the snapshot `hashes` started from
    last_seq: int = 0
    stale: bool = True
    snapshot_pending: bool = False
    buffered: list[KVEvents] = field(default_factory=list)
    num_resyncs: int = 0


class KVIndex:
    def __init__(self, request_snapshot: Callable[[str], None]) -> None:
        self._request_snapshot = request_snapshot
        self._pubs: dict[str, _Publisher] = {}

    # -- membership ----------------------------------------------------------------------

    def add_publisher(self, publisher_id: str) -> None:
        """(Re)start tracking a publisher from scratch: stale until its snapshot arrives."""
        self._pubs[publisher_id] = _Publisher()
        self._resync(publisher_id, self._pubs[publisher_id])

    def remove_publisher(self, publisher_id: str) -> None:
        self._pubs.pop(publisher_id, None)

    def publishers(self) -> list[str]:
        return list(self._pubs)

    # -- updates -------------------------------------------------------------------------

    def apply(self, ev: KVEvents) -> None:
        pub = self._pubs.get(ev.publisher_id)
        if pub is None:  # first contact without registration: track it anyway
            pub = self._pubs[ev.publisher_id] = _Publisher()
            self._buffer(pub, ev)
            self._resync(ev.publisher_id, pub)
            return
        if pub.stale:
            self._buffer(pub, ev)
            if not pub.snapshot_pending:
                self._resync(ev.publisher_id, pub)
            return
        if ev.epoch != pub.epoch:  # the publisher restarted: its seq began again
            self._buffer(pub, ev)
            self._resync(ev.publisher_id, pub)
            return
        if ev.seq <= pub.last_seq:
            return
        if ev.seq != pub.last_seq + 1:
            pub.stale = True
            self._buffer(pub, ev)
            self._resync(ev.publisher_id, pub)
            return
        _apply_one(pub, ev)

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        pub = self._pubs.get(snap.publisher_id)
        if pub is None:
            return
        pub.snapshot_pending = False
        pub.hashes = set(snap.block_hashes)
        pub.epoch = snap.epoch
        pub.last_seq = snap.seq
        pending = sorted(
            (e for e in pub.buffered if e.epoch == snap.epoch and e.seq > snap.seq),
            key=lambda e: e.seq,
        )
        pub.buffered = []
        for i, ev in enumerate(pending):
            if ev.seq != pub.last_seq + 1:
                pub.buffered = pending[i:]
                self._resync(snap.publisher_id, pub)
                return
            _apply_one(pub, ev)
        pub.stale = False

    def snapshot_failed(self, publisher_id: str) -> None:
        """The snapshot request failed: the next event asks again."""
        pub = self._pubs.get(publisher_id)
        if pub is not None:
            pub.snapshot_pending = False

    # -- queries -------------------------------------------------------------------------

    def is_stale(self, publisher_id: str) -> bool:
        pub = self._pubs.get(publisher_id)
        return pub is None or pub.stale

    def num_blocks(self, publisher_id: str) -> int | None:
        """Blocks the publisher holds, as far as its events tell; None while stale."""
        pub = self._pubs.get(publisher_id)
        return None if pub is None or pub.stale else len(pub.hashes)

    def num_resyncs(self, publisher_id: str) -> int:
        pub = self._pubs.get(publisher_id)
        return 0 if pub is None else pub.num_resyncs

    def matched_prefix(self, publisher_id: str, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of `hashes` the publisher holds (0 while stale)."""
        pub = self._pubs.get(publisher_id)
        if pub is None or pub.stale:
            return 0
        held = pub.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    # -- internals -----------------------------------------------------------------------

    def _buffer(self, pub: _Publisher, ev: KVEvents) -> None:
        pub.buffered.append(ev)
        if len(pub.buffered) > _MAX_BUFFERED:
            del pub.buffered[: len(pub.buffered) - _MAX_BUFFERED]

    def _resync(self, publisher_id: str, pub: _Publisher) -> None:
        pub.stale = True
        pub.snapshot_pending = True
        pub.num_resyncs += 1
        self._request_snapshot(publisher_id)


def _apply_one(pub: _Publisher, ev: KVEvents) -> None:
    if ev.cleared:
        pub.hashes.clear()
    pub.hashes.difference_update(ev.removed)
    pub.hashes.update(ev.stored)
    pub.last_seq = ev.seq
