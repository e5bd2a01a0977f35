"""Routing policies: which worker runs a request.

Pure Python. The router builds one `Candidate` per usable worker (its load as the router
knows it, and, for policies that want it, the request's cached prefix there from the KV index)
and asks a policy to choose. Every choice comes with a `RouteDecision` for metrics and tracing.

- `RoundRobin`: cycles through workers in id order (stable when workers join or leave).
- `LeastLoad`: fewest running + waiting sequences, then most free KV blocks.
- `PrefixAware`: the longest cached prefix wins unless that worker's load exceeds the least
  loaded worker's by more than `load_threshold` sequences; equal prefixes go to the lower load.
  A worker whose KV view is being resynced reports a prefix of 0 (never a stale score).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Decision outcomes (label values of llmfleet:routing_decisions_total).
OUTCOME_ROTATED = "rotated"
OUTCOME_LEAST_LOAD = "least_load"
OUTCOME_PREFIX_HIT = "prefix_hit"
OUTCOME_NO_PREFIX = "no_prefix"
OUTCOME_LOAD_FALLBACK = "load_fallback"


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    num_requests: int  # running + waiting sequences
    num_free_blocks: int = 0
    prefix_blocks: int = 0  # request's cached prefix on this worker, in blocks


@dataclass(frozen=True)
class RouteDecision:
    policy: str
    worker_id: str
    matched_prefix_tokens: int
    outcome: str


class Policy(Protocol):
    name: str
    needs_prefix: bool

    def choose(self, candidates: Sequence[Candidate], block_size: int) -> RouteDecision:
        """Pick one of `candidates` (non-empty)."""
        ...


def _load_key(c: Candidate) -> tuple[int, int, str]:
    return (c.num_requests, -c.num_free_blocks, c.worker_id)


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("no candidates to route to")


class RoundRobin:
    name = "round_robin"
    needs_prefix = False

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, candidates: Sequence[Candidate], block_size: int) -> RouteDecision:
        _require(candidates)
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        pick = ordered[0]
        if self._last is not None:
            pick = next((c for c in ordered if c.worker_id > self._last), ordered[0])
        self._last = pick.worker_id
        return RouteDecision(
            self.name, pick.worker_id, pick.prefix_blocks * block_size, OUTCOME_ROTATED
        )


class LeastLoad:
    name = "least_load"
    needs_prefix = False

    def choose(self, candidates: Sequence[Candidate], block_size: int) -> RouteDecision:
        _require(candidates)
        pick = min(candidates, key=_load_key)
        return RouteDecision(
            self.name, pick.worker_id, pick.prefix_blocks * block_size, OUTCOME_LEAST_LOAD
        )


class PrefixAware:
    name = "prefix_aware"
    needs_prefix = True

    def __init__(self, load_threshold: int) -> None:
        if load_threshold < 0:
            raise ValueError("load_threshold must be >= 0")
        self.load_threshold = load_threshold

    def choose(self, candidates: Sequence[Candidate], block_size: int) -> RouteDecision:
        _require(candidates)
        least = min(candidates, key=_load_key)
        best = min(candidates, key=lambda c: (-c.prefix_blocks, *_load_key(c)))
        if best.prefix_blocks == 0:
            pick, outcome = least, OUTCOME_NO_PREFIX
        elif best.num_requests - least.num_requests > self.load_threshold:
            pick, outcome = least, OUTCOME_LOAD_FALLBACK
        else:
            pick, outcome = best, OUTCOME_PREFIX_HIT
        return RouteDecision(self.name, pick.worker_id, pick.prefix_blocks * block_size, outcome)


def make_policy(name: str, prefix_load_threshold: int = 4) -> Policy:
    if name == RoundRobin.name:
        return RoundRobin()
    if name == LeastLoad.name:
        return LeastLoad()
    if name == PrefixAware.name:
        return PrefixAware(prefix_load_threshold)
    raise ValueError(f"unknown routing policy {name!r}")
