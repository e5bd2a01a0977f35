"""KV leases granted by a decode worker: the handoff's state machine, plain Python.

A lease covers the blocks reserved for one request's prompt KV, which a prefill worker pushes:

    RESERVED --push--> RECEIVING --all blocks--> (still RECEIVING, complete)
        |                  |                         |
        |                  +------ commit (StartDecode, complete only) ----> COMMITTED
        +--- release (ReleaseKV) ---> RELEASED
        +--- expiry (past expires_at, not committed) ---> EXPIRED

COMMITTED, RELEASED and EXPIRED are terminal: every later operation on the lease is rejected
(the blocks are gone or belong to a running request). Each grant gets a new epoch, strictly
increasing over the table's life, and an operation must name the lease's epoch: a late message
from an earlier attempt carries another epoch and is dropped. Expiry is checked on every
operation, not only by the periodic `expire` sweep, so a lease is never used past its expiry.

The table owns lease state only; the engine's blocks are freed by the caller for each lease
that `release` or `expire` ends. A lease lives at most MAX_LEASE_TTL_MS (10 minutes): a longer
TTL is refused (ValidationError of `ttl_ms`). The clock is injectable (seconds; wall time by
default, since `expires_at` travels to other processes as Unix milliseconds).
"""

from __future__ import annotations

import enum
import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import prometheus_client

from llmfleet.shared.core.config import MAX_LEASE_TTL_MS
from llmfleet.shared.core.errors import ValidationError


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    COMMITTED = "committed"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in (LeaseState.COMMITTED, LeaseState.RELEASED, LeaseState.EXPIRED)


# The decode worker's view of the handoff: leases granted ("reserved") and ended, by how they
# ended. The router counts its own view (`llmfleet:lease_outcomes_total`).
LEASE_TRANSITIONS = prometheus_client.Counter(
    "llmfleet:kv_leases",
    "KV leases granted (state=reserved) and ended (committed, released, expired)",
    ["state"],
)
for _state in ("reserved", "committed", "released", "expired"):  # exported at 0 from the start
    LEASE_TRANSITIONS.labels(_state)


class LeaseError(Exception):
    """An operation that does not apply to a lease (unknown, wrong epoch, expired, ...)."""


@dataclass
class Lease:
    lease_id: str
    epoch: int
    request_id: str
    num_prompt_tokens: int
    num_blocks: int
    expires_at: float  # clock seconds
    state: LeaseState = LeaseState.RESERVED
    received: set[int] = field(default_factory=set)  # block indices written so far

    @property
    def complete(self) -> bool:
        return len(self.received) == self.num_blocks

    @property
    def expires_at_ms(self) -> int:
        return int(self.expires_at * 1000)


class LeaseTable:
    def __init__(
        self, clock: Callable[[], float] = time.time, *, max_terminal_kept: int = 4096
    ) -> None:
        self._clock = clock
        self._epochs = itertools.count(1)
        self._active: dict[str, Lease] = {}
        # Ended leases, kept (bounded) so late operations get a precise error.
        self._ended: OrderedDict[str, Lease] = OrderedDict()
        self._max_ended = max_terminal_kept
        self._expired_unreported: list[Lease] = []  # expired inside `get`, not yet returned

    def __len__(self) -> int:
        return len(self._active)

    def active(self) -> list[Lease]:
        return list(self._active.values())

    def grant(
        self, request_id: str, num_prompt_tokens: int, num_blocks: int, ttl_s: float
    ) -> Lease:
        if not 0 < ttl_s <= MAX_LEASE_TTL_MS / 1000:
            raise ValidationError(
                "ttl_ms", f"must be in (0, {MAX_LEASE_TTL_MS}] ms, got {ttl_s * 1000:.0f}"
            )
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            epoch=next(self._epochs),
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            num_blocks=num_blocks,
            expires_at=self._clock() + ttl_s,
        )
        self._active[lease.lease_id] = lease
        LEASE_TRANSITIONS.labels(LeaseState.RESERVED.value).inc()
        return lease

    def get(self, lease_id: str, epoch: int) -> Lease:
        """The live lease with this id and epoch; LeaseError otherwise (expiring it if due)."""
        lease = self._active.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            if ended is None:
                raise LeaseError(f"unknown lease {lease_id!r}")
            raise LeaseError(f"lease {lease_id!r} is {ended.state.value}")
        if lease.epoch != epoch:
            raise LeaseError(f"lease {lease_id!r} has epoch {lease.epoch}, not {epoch}")
        if self._clock() >= lease.expires_at:
            self._end(lease, LeaseState.EXPIRED)
            raise LeaseError(f"lease {lease_id!r} is expired")
        return lease

    def check_push(self, lease_id: str, epoch: int, first_block: int, num_blocks: int) -> Lease:
        """Validate a push of blocks [first_block, first_block + num_blocks) before writing."""
        lease = self.get(lease_id, epoch)
        if num_blocks < 1 or first_block < 0 or first_block + num_blocks > lease.num_blocks:
            raise LeaseError(
                f"blocks [{first_block}, {first_block + num_blocks}) outside the lease's "
                f"{lease.num_blocks}"
            )
        return lease

    def record_push(self, lease: Lease, first_block: int, num_blocks: int) -> None:
        """The blocks of a checked push are written (a re-push of the same blocks is fine)."""
        if lease.state.terminal:
            raise LeaseError(f"lease {lease.lease_id!r} is {lease.state.value}")
        lease.state = LeaseState.RECEIVING
        lease.received.update(range(first_block, first_block + num_blocks))

    def commit(self, lease_id: str, epoch: int, request_id: str) -> Lease:
        """StartDecode: the lease's KV is complete and becomes a running request's."""
        lease = self.get(lease_id, epoch)
        if lease.request_id != request_id:
            raise LeaseError(f"lease {lease_id!r} is for request {lease.request_id!r}")
        if not lease.complete:
            raise LeaseError(
                f"lease {lease_id!r} has {len(lease.received)} of {lease.num_blocks} blocks"
            )
        self._end(lease, LeaseState.COMMITTED)
        return lease

    def release(self, lease_id: str, epoch: int) -> Lease | None:
        """ReleaseKV: end the lease; None if it is unknown, ended or of another epoch."""
        lease = self._active.get(lease_id)
        if lease is None or lease.epoch != epoch:
            return None
        self._end(lease, LeaseState.RELEASED)
        return lease

    def expire(self) -> list[Lease]:
        """End every live lease past its expiry; returns each expired lease exactly once
        (including those an operation found expired), so the caller frees their blocks."""
        now = self._clock()
        for lease in [x for x in self._active.values() if now >= x.expires_at]:
            self._end(lease, LeaseState.EXPIRED)
        out, self._expired_unreported = self._expired_unreported, []
        return out

    def _end(self, lease: Lease, state: LeaseState) -> None:
        lease.state = state
        LEASE_TRANSITIONS.labels(state.value).inc()
        del self._active[lease.lease_id]
        self._ended[lease.lease_id] = lease
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)
        if state is LeaseState.EXPIRED:
            self._expired_unreported.append(lease)
