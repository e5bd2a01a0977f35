"""The worker table: who is registered, in which role, how loaded, and who is still alive.

Pure Python (no grpc/protobuf): the Registry servicer converts messages into the frozen
dataclasses below. A worker is *live* while its last heartbeat (or registration) is younger
than `heartbeat_timeout_ms` (outputs streamed from it count as a heartbeat); only live
workers that are not draining receive new requests. Removing a worker (deregistered,
or declared dead after a channel failure) makes its next heartbeat answer `known=False`, which
tells it to register again. Mutated only by the router's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmfleet.shared.core.model_info import ModelInfo

ROLE_UNIFIED = "unified"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_UNIFIED, ROLE_PREFILL, ROLE_DECODE)


@dataclass(frozen=True)
class Load:
    """A worker's last load report."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_active_leases: int = 0
    num_queued_prompt_tokens: int = 0
    step_seconds: float = 0.0  # measured by the worker; 0: not yet
    prefill_seconds_per_token: float = 0.0
    fetch_seconds_per_token: float = 0.0
    step_seconds_per_seq: float = 0.0
    max_num_batched_tokens: int = 0  # 0: not reported

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    address: str
    kv_events_endpoint: str
    model: ModelInfo
    load: Load = field(default_factory=Load)
    last_heartbeat: float = 0.0  # clock() seconds: its last heartbeat or streamed output
    draining: bool = False  # finishing what it runs; receives no new requests


@dataclass(frozen=True)
class Registration:
    """What a (re-)registration changed, so the servicer knows what to (re)connect."""

    worker: WorkerInfo
    is_new: bool
    address_changed: bool
    events_changed: bool


class WorkerRegistry:
    def __init__(
        self, heartbeat_timeout_ms: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if heartbeat_timeout_ms < 1:
            raise ValueError("heartbeat_timeout_ms must be >= 1")
        self.timeout_s = heartbeat_timeout_ms / 1000.0
        self.clock = clock
        self._workers: dict[str, WorkerInfo] = {}

    def register(
        self,
        worker_id: str,
        role: str,
        address: str,
        kv_events_endpoint: str,
        model: ModelInfo,
        load: Load | None = None,
    ) -> Registration:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        old = self._workers.get(worker_id)
        info = WorkerInfo(
            worker_id=worker_id,
            role=role,
            address=address,
            kv_events_endpoint=kv_events_endpoint,
            model=model,
            load=load or Load(),
            last_heartbeat=self.clock(),
        )
        self._workers[worker_id] = info
        return Registration(
            worker=info,
            is_new=old is None,
            address_changed=old is None or old.address != address,
            events_changed=old is None or old.kv_events_endpoint != kv_events_endpoint,
        )

    def heartbeat(self, worker_id: str, load: Load | None) -> bool:
        """Record liveness (and load); False when the worker is unknown (it must register)."""
        old = self._workers.get(worker_id)
        if old is None:
            return False
        self._workers[worker_id] = replace(
            old, load=load if load is not None else old.load, last_heartbeat=self.clock()
        )
        return True

    def touch(self, worker_id: str) -> None:
        """Outputs streamed from the worker: it is alive even if a heartbeat is late (a starved
        CPU delays heartbeats, not the tokens already flowing)."""
        old = self._workers.get(worker_id)
        now = self.clock()
        # Called per received step: refresh only when a tenth of the timeout has passed (the
        # record is immutable, so each refresh copies it).
        if old is not None and now - old.last_heartbeat > self.timeout_s / 10:
            self._workers[worker_id] = replace(old, last_heartbeat=now)

    def set_draining(self, worker_id: str) -> bool:
        """The worker takes no new requests (it stays known and live for what it runs)."""
        old = self._workers.get(worker_id)
        if old is None:
            return False
        self._workers[worker_id] = replace(old, draining=True)
        return True

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def is_live(self, worker_id: str) -> bool:
        info = self._workers.get(worker_id)
        return info is not None and self.clock() - info.last_heartbeat <= self.timeout_s

    def live(self, role: str | None = None) -> list[WorkerInfo]:
        """Live workers (of `role`, if given) for new requests, in registration order: those
        not draining, or, when every one drains (a whole fleet stopping), the draining ones."""
        now = self.clock()
        alive = [
            w
            for w in self._workers.values()
            if now - w.last_heartbeat <= self.timeout_s and (role is None or w.role == role)
        ]
        return [w for w in alive if not w.draining] or alive

    def taking(self, role: str) -> bool:
        """Whether a live worker of `role` is not draining."""
        return any(not w.draining for w in self.live(role))

    def expired(self) -> list[WorkerInfo]:
        """Registered workers whose heartbeats stopped (still in the table)."""
        now = self.clock()
        return [w for w in self._workers.values() if now - w.last_heartbeat > self.timeout_s]

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def model(self, roles: tuple[str, ...] = ROLES) -> ModelInfo | None:
        """The served model as the live workers of `roles` agree on it: the first one's id and
        block size, the tightest of their limits. None when no such worker is live."""
        specs = [w.model for w in self.live() if w.role in roles]
        if not specs:
            return None
        first = specs[0]
        return replace(
            first,
            vocab_size=min(s.vocab_size for s in specs),
            max_model_len=min(s.max_model_len for s in specs),
            max_n=min(s.max_n for s in specs),
            max_logprobs=min(s.max_logprobs for s in specs),
        )
