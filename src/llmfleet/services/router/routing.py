"""Routing policies: which worker runs a request.

Pure Python. The router builds one `Candidate` per usable worker (its load as the router
knows it, and, for policies that want it, the request's cached prefix there from the KV index)
and asks a policy to choose. Every choice comes with a `RouteDecision` for metrics and tracing.

- `RoundRobin`: cycles through workers in id order (stable when workers join or leave).
- `LeastLoad`: fewest running + waiting sequences, then most free KV blocks.
- `PrefixAware`: the longest cached prefix wins unless that worker's load exceeds the least
  loaded worker's by more than `load_threshold` sequences; equal prefixes go to the lower load.
  A worker whose KV view is being resynced reports a prefix of 0 (never a stale score).
- `PredictedTTFT`: the worker with the least predicted time to first token (below), ties
  (within `TIE_FRACTION`) to the least loaded. No thresholds: its coefficients are each
  worker's own measured step times (`StepTimeModel`, in the worker's load reports).
- `DecodeHeadroom`: for a disaggregated request's decode worker (the prompt's KV arrives by
  push, so no prefix counts): the least predicted decode step once the request joins
  (`step_s + (requests + 1) * step_s_per_seq`) plus the same KV-pressure term, ties to the
  least loaded. The router uses it beside `PredictedTTFT`.

Predicted TTFT on a worker, for a prompt of N tokens of which the worker caches `local` and
the kvstore holds `store` more (fetched instead of computed):

    compute = N - local - store                       (at least the last token)
    ttft    = step_s + (requests + 1) * step_s_per_seq   (the step that finishes the prompt,
                                                      beside the batch it joins)
            + (queued + compute) * prefill_s_per_token   (prompt tokens ahead of it, and its own)
            + store * fetch_s_per_token
            + pressure

where `queued` is the prompt tokens admitted there and not yet computed, and `pressure`, when
the prompt needs more blocks than are free, is the deficit's share of the cache times
`PRESSURE_HORIZON_STEPS` steps: the wait for running requests to free memory (or be
preempted, which costs their recomputation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from llmfleet.shared.core.step_model import DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_STEP_S

# Decision outcomes (label values of llmfleet:routing_decisions_total).
OUTCOME_ROTATED = "rotated"
OUTCOME_LEAST_LOAD = "least_load"
OUTCOME_PREFIX_HIT = "prefix_hit"
OUTCOME_NO_PREFIX = "no_prefix"
OUTCOME_LOAD_FALLBACK = "load_fallback"
OUTCOME_PREDICTED = "predicted"

# A fetch from the kvstore moves KV bytes instead of computing them: until measured, a tenth
# of the prefill prior per token.
DEFAULT_FETCH_S_PER_TOKEN = DEFAULT_PREFILL_S_PER_TOKEN / 10
TIE_FRACTION = 0.05  # predictions this close to the best are ties (broken by load)
PRESSURE_HORIZON_STEPS = 256  # steps for running requests to free a whole cache


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    num_requests: int  # running + waiting sequences
    num_free_blocks: int = 0
    prefix_blocks: int = 0  # request's cached prefix on this worker, in blocks
    # For PredictedTTFT (the others ignore them):
    num_total_blocks: int = 0  # 0: unknown (no pressure term)
    queued_prompt_tokens: int = 0  # admitted there, not computed yet
    store_blocks: int = 0  # request's prefix the kvstore holds, in blocks (any worker fetches)
    step_s: float = DEFAULT_STEP_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    fetch_s_per_token: float = DEFAULT_FETCH_S_PER_TOKEN
    step_s_per_seq: float = 0.0  # what each sequence in its batch adds to a step


@dataclass(frozen=True)
class RouteDecision:
    policy: str
    worker_id: str
    matched_prefix_tokens: int
    outcome: str
    predicted_ttft_s: float | None = None  # PredictedTTFT's prediction for the winner
    predictions: tuple[tuple[str, float], ...] = ()  # (worker id, predicted TTFT s) each


class Policy(Protocol):
    name: str
    needs_prefix: bool

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
        """Pick one of `candidates` (non-empty) for a prompt of `num_prompt_tokens`."""
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

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
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

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
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

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
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


class PredictedTTFT:
    name = "predicted_ttft"
    needs_prefix = True

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
        _require(candidates)
        scored = [(predict_ttft(c, block_size, num_prompt_tokens), c) for c in candidates]
        ttft, pick = _least_predicted(scored)
        return RouteDecision(
            self.name,
            pick.worker_id,
            pick.prefix_blocks * block_size,
            OUTCOME_PREDICTED,
            ttft,
            tuple((c.worker_id, t) for t, c in scored),
        )


class DecodeHeadroom:
    name = "decode_headroom"
    needs_prefix = False

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
        _require(candidates)
        scored = [(predict_decode_step(c, block_size, num_prompt_tokens), c) for c in candidates]
        _, pick = _least_predicted(scored)
        return RouteDecision(self.name, pick.worker_id, 0, OUTCOME_PREDICTED)


def _least_predicted(scored: Sequence[tuple[float, Candidate]]) -> tuple[float, Candidate]:
    """The least predicted candidate and its prediction; predictions within TIE_FRACTION of
    the least are ties, which go to the least loaded."""
    best = min(t for t, _ in scored)
    t, pick = min(
        ((t, c) for t, c in scored if t <= best * (1 + TIE_FRACTION)),
        key=lambda tc: _load_key(tc[1]),
    )
    return t, pick


def predict_decode_step(c: Candidate, block_size: int, num_prompt_tokens: int) -> float:
    """Seconds of `c`'s decode step once a request with this prompt joins it, KV pressure
    included (its blocks must be reserved before the prompt's KV is pushed)."""
    return _joined_step(c) + _pressure(c, -(-max(1, num_prompt_tokens) // block_size))


def _joined_step(c: Candidate) -> float:
    """`c`'s step once one more request joins its batch."""
    return c.step_s + (c.num_requests + 1) * c.step_s_per_seq


def _pressure(c: Candidate, needed_blocks: int) -> float:
    """The wait for memory when `needed_blocks` exceed the free ones (module docstring)."""
    if c.num_total_blocks <= 0 or needed_blocks <= c.num_free_blocks:
        return 0.0
    deficit = (needed_blocks - c.num_free_blocks) / c.num_total_blocks
    return deficit * PRESSURE_HORIZON_STEPS * c.step_s


def predict_ttft(c: Candidate, block_size: int, num_prompt_tokens: int) -> float:
    """Seconds to the first token of a prompt of `num_prompt_tokens` on `c` (module docstring)."""
    n = max(1, num_prompt_tokens)
    local = min(n, c.prefix_blocks * block_size)
    store = max(0, min(n, c.store_blocks * block_size) - local)
    compute = max(1, n - local - store)
    ttft = (
        _joined_step(c)
        + (c.queued_prompt_tokens + compute) * c.prefill_s_per_token
        + store * c.fetch_s_per_token
    )
    blocks = -(-n // block_size)
    return ttft + _pressure(c, blocks - min(c.prefix_blocks, blocks))


def make_policy(name: str, prefix_load_threshold: int = 4) -> Policy:
    if name == RoundRobin.name:
        return RoundRobin()
    if name == LeastLoad.name:
        return LeastLoad()
    if name == PrefixAware.name:
        return PrefixAware(prefix_load_threshold)
    if name == PredictedTTFT.name:
        return PredictedTTFT()
    raise ValueError(f"unknown routing policy {name!r}")
