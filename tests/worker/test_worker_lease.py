"""The lease table: epochs, expiry with an injected clock, states, late/wrong-epoch rejection."""

from __future__ import annotations

import pytest

from llmfleet.services.worker.lease import LeaseError, LeaseState, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_epochs_increase_and_ids_are_unique(clock):
    t = LeaseTable(clock)
    leases = [t.grant(f"r{i}", 10, 3, 1.0) for i in range(5)]
    assert [x.epoch for x in leases] == sorted({x.epoch for x in leases})
    assert len({x.lease_id for x in leases}) == 5
    assert leases[0].expires_at_ms == 1_001_000
    assert len(t) == 5


def test_push_then_commit(clock):
    t = LeaseTable(clock)
    lease = t.grant("r", 10, 3, 1.0)
    assert lease.state is LeaseState.RESERVED
    with pytest.raises(LeaseError, match="0 of 3"):
        t.commit(lease.lease_id, lease.epoch, "r")
    t.record_push(t.check_push(lease.lease_id, lease.epoch, 0, 2), 0, 2)
    assert lease.state is LeaseState.RECEIVING and not lease.complete
    t.record_push(t.check_push(lease.lease_id, lease.epoch, 2, 1), 2, 1)
    assert lease.complete
    with pytest.raises(LeaseError, match="request"):
        t.commit(lease.lease_id, lease.epoch, "other")
    assert t.commit(lease.lease_id, lease.epoch, "r").state is LeaseState.COMMITTED
    assert len(t) == 0
    # everything after a commit is rejected
    with pytest.raises(LeaseError, match="committed"):
        t.check_push(lease.lease_id, lease.epoch, 0, 1)
    assert t.release(lease.lease_id, lease.epoch) is None


def test_wrong_epoch_and_out_of_range_rejected(clock):
    t = LeaseTable(clock)
    lease = t.grant("r", 10, 3, 1.0)
    with pytest.raises(LeaseError, match="epoch"):
        t.check_push(lease.lease_id, lease.epoch + 1, 0, 1)
    with pytest.raises(LeaseError, match="outside"):
        t.check_push(lease.lease_id, lease.epoch, 2, 2)
    with pytest.raises(LeaseError, match="unknown"):
        t.check_push("nope", 1, 0, 1)
    assert t.release(lease.lease_id, lease.epoch - 1) is None  # wrong epoch: not released
    assert t.release(lease.lease_id, lease.epoch).state is LeaseState.RELEASED
    assert t.release(lease.lease_id, lease.epoch) is None  # twice: no-op
    with pytest.raises(LeaseError, match="released"):
        t.commit(lease.lease_id, lease.epoch, "r")


def test_expiry_by_sweep_and_by_late_operation(clock):
    t = LeaseTable(clock)
    a = t.grant("a", 10, 1, 1.0)
    b = t.grant("b", 10, 1, 2.0)
    clock.now += 1.5
    assert [x.lease_id for x in t.expire()] == [a.lease_id]
    assert a.state is LeaseState.EXPIRED
    assert t.expire() == []  # reported once
    with pytest.raises(LeaseError, match="expired"):
        t.check_push(a.lease_id, a.epoch, 0, 1)
    clock.now += 1.0
    with pytest.raises(LeaseError, match="expired"):  # found expired by the operation itself
        t.commit(b.lease_id, b.epoch, "b")
    assert [x.lease_id for x in t.expire()] == [b.lease_id]  # its blocks still get freed
    assert len(t) == 0


def test_ended_leases_kept_bounded(clock):
    t = LeaseTable(clock, max_terminal_kept=2)
    ids = []
    for i in range(4):
        x = t.grant(f"r{i}", 1, 1, 1.0)
        t.release(x.lease_id, x.epoch)
        ids.append((x.lease_id, x.epoch))
    with pytest.raises(LeaseError, match="unknown"):
        t.get(*ids[0])
    with pytest.raises(LeaseError, match="released"):
        t.get(*ids[3])
