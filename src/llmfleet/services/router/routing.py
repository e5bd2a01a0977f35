"""Routing policies: which worker runs a request.

Pure Python. The router builds one `Candidate` per usable worker (its load as the router
knows it, and, for policies that want it, the request's cached prefix there from the KV index)
and asks a policy to choose. Every choice comes with a `RouteDecision` for metrics and tracing.

- `RoundRobin`: cycles through workers in id order (stable when workers join or leave).
- `LeastLoad`: fewest running + waiting sequences, then most free KV blocks.
- `PrefixAware`: the longest cached prefix wins unless that worker's load exceeds the least
  loaded worker's by more than `load_threshold` sequences; equal prefixes go to the lower load.
  A worker whose KV view is being resynced reports a prefix of 0 (never a stale score).
- `PredictedTTFT`: the worker with the least predicted latency cost: the request's predicted
  time to first token there, plus the delay its prompt compute puts on the requests that will
  queue behind it (below). Ties (within one decode step of the least: below what the
  prediction resolves) go to the worker that served the request's session last (its
  `affinity` hint: the conversation's KV is there, though the KV index may not show it yet),
  then to the least loaded. No thresholds: its coefficients are each worker's own measured
  step times (`StepTimeModel`, in the worker's load reports); a worker that has not measured
  one yet is scored with its measured peers' mean (`with_peer_costs`), else the prior.
- `DecodeHeadroom`: for a disaggregated request's decode worker (the prompt's KV arrives by
  push, so no prefix counts): the least predicted time to its first decode step there: the
  push of its KV behind the pushes already leased there (`(incoming + N) * fetch_s_per_token`,
  the first token waits for it), then a step once the request joins
  (`step_s + (requests + 1) * step_s_per_seq`), plus the same KV-pressure term; ties to the
  least loaded (within `TIE_FRACTION`). The router uses it beside `PredictedTTFT`.

Predicted TTFT on a worker, for a prompt of N tokens of which the worker caches `local` and
the kvstore holds `store` more (fetched instead of computed):

    compute = N - local - store                       (at least the last token)
    prompt  = queued + compute                        (prompt tokens ahead of it, and its own)
    steps   = ceil(prompt / (budget - requests))      (the steps they take, beside the batch)
    ttft    = steps * (step_s + (requests + 1) * step_s_per_seq)
            + prompt * prefill_s_per_token
            + (incoming + store) * fetch_s_per_token     (only when store > 0)
            + pressure

where `queued` is the prompt tokens admitted there and not yet computed (less the prefix a
waiting request found cached), `incoming` the tokens already on their way there (fetches
go one after another: under load a fetch waits for those routed before it), `budget` the
worker's tokens per step (1 step if unknown: each step also decodes its running batch, and a
deep queue takes many), and `pressure`, when the prompt needs more blocks than are free, is
the deficit's share of the cache times `PRESSURE_HORIZON_STEPS` steps: the wait for running
requests to free memory (or be preempted, which costs their recomputation).

The cost the policy minimizes adds what the choice costs the others, the delay its prompt's
compute (`compute_s = compute * prefill_s_per_token`) puts on the requests queued behind it:

    cost = ttft + compute_s * (queued_requests + arrival_rate * compute_s / 2)

`queued_requests` is the requests there without a first token yet: in a steady queue about as
many arrive while a prompt waits (Little's law), and each of them waits `compute_s` longer.
`arrival_rate * compute_s` more arrive while it computes, `compute_s / 2` later on average;
`arrival_rate` is the requests per second the policy routes, shared by the candidates. On an
idle fleet with a trickle of requests the cost is the TTFT. Under load a recomputed prefix
costs the whole queue, so requests stay with the worker holding their prefix unless another's
queue is shorter by that much: the caches keep their tenants, and the fleet's throughput rises
with its hit rate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmfleet.shared.core.step_model import DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_STEP_S, mix

# Decision outcomes (label values of llmfleet:routing_decisions_total).
OUTCOME_ROTATED = "rotated"
OUTCOME_LEAST_LOAD = "least_load"
OUTCOME_PREFIX_HIT = "prefix_hit"
OUTCOME_NO_PREFIX = "no_prefix"
OUTCOME_LOAD_FALLBACK = "load_fallback"
OUTCOME_PREDICTED = "predicted"
OUTCOME_PINNED = "pinned"  # the worker the request's call named (placement.py, pinning.py)

# A fetch from the kvstore moves KV bytes instead of computing them: until measured, a tenth
# of the prefill prior per token.
DEFAULT_FETCH_S_PER_TOKEN = DEFAULT_PREFILL_S_PER_TOKEN / 10
TIE_FRACTION = 0.05  # decode steps this close to the least are ties (broken by load)
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
    # Measured by the worker; 0: not yet (the scorers use their measured peers' mean, else the
    # priors, which are the defaults).
    step_s: float = DEFAULT_STEP_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    fetch_s_per_token: float = DEFAULT_FETCH_S_PER_TOKEN
    step_s_per_seq: float = 0.0  # what each sequence in its batch adds to a step
    num_queued: int = 0  # requests there without a first token yet
    step_token_budget: int = 0  # tokens a step computes at most (0: unknown, one step)
    affinity: bool = False  # served the request's session last (a hint: wins ties)
    incoming_kv_tokens: int = 0  # KV leased there and not pushed yet (decode workers)


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

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # seconds; the arrival rate is measured on it
        self._last: float | None = None
        self._gap_s = 0.0  # moving average of the time between decisions
        self._num_gaps = 0

    @property
    def arrival_rate(self) -> float:
        """Requests per second this policy routes, as measured (0 until two were)."""
        return 1.0 / self._gap_s if self._gap_s > 0 else 0.0

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
        _require(candidates)
        candidates = with_peer_costs(candidates)
        now = self._clock()
        if self._last is not None:
            self._gap_s = mix(self._gap_s, max(0.0, now - self._last), self._num_gaps, 0.02)
            self._num_gaps += 1
        self._last = now
        rate = self.arrival_rate / len(candidates)
        ttfts = {c.worker_id: predict_ttft(c, block_size, num_prompt_tokens) for c in candidates}
        scored = [
            (ttfts[c.worker_id] + imposed_delay(c, block_size, num_prompt_tokens, rate), c)
            for c in candidates
        ]
        best_cost, best = min(scored, key=lambda tc: tc[0])
        _, pick = _least_loaded_within(scored, best_cost + best.step_s)
        return RouteDecision(
            self.name,
            pick.worker_id,
            pick.prefix_blocks * block_size,
            OUTCOME_PREDICTED,
            ttfts[pick.worker_id],
            tuple(ttfts.items()),
        )


class DecodeHeadroom:
    name = "decode_headroom"
    needs_prefix = False

    def choose(
        self, candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int = 0
    ) -> RouteDecision:
        _require(candidates)
        candidates = with_peer_costs(candidates)
        scored = [(predict_decode_step(c, block_size, num_prompt_tokens), c) for c in candidates]
        best = min(t for t, _ in scored)
        _, pick = _least_loaded_within(scored, best * (1 + TIE_FRACTION))
        return RouteDecision(self.name, pick.worker_id, 0, OUTCOME_PREDICTED)


def with_peer_costs(candidates: Sequence[Candidate]) -> Sequence[Candidate]:
    """Candidates whose worker has not measured a cost yet (0) with their measured peers' mean
    (the same model, most likely on like hardware), or the prior when no peer has measured it:
    a new worker is neither a bargain nor a risk until its own steps say so."""

    def mean(field: str, prior: float) -> float:
        measured = [v for c in candidates if (v := getattr(c, field)) > 0]
        return sum(measured) / len(measured) if measured else prior

    if all(c.step_s and c.prefill_s_per_token and c.fetch_s_per_token for c in candidates):
        return candidates
    step = mean("step_s", DEFAULT_STEP_S)
    per_seq = [c.step_s_per_seq for c in candidates if c.step_s > 0]
    filled = {
        "prefill_s_per_token": mean("prefill_s_per_token", DEFAULT_PREFILL_S_PER_TOKEN),
        "fetch_s_per_token": mean("fetch_s_per_token", DEFAULT_FETCH_S_PER_TOKEN),
    }
    out = []
    for c in candidates:
        changes = {f: v for f, v in filled.items() if getattr(c, f) <= 0}
        if c.step_s <= 0:  # no decode step measured: neither its base nor its slope
            changes.update(step_s=step, step_s_per_seq=sum(per_seq) / max(1, len(per_seq)))
        out.append(dataclasses.replace(c, **changes) if changes else c)
    return out


def _least_loaded_within(
    scored: Sequence[tuple[float, Candidate]], limit: float
) -> tuple[float, Candidate]:
    """Of the candidates predicted at most `limit` (ties with the least), the least loaded,
    with its prediction; a session's own worker first (DecodeHeadroom's candidates have none)."""
    return min(
        ((t, c) for t, c in scored if t <= limit),
        key=lambda tc: (not tc[1].affinity, *_load_key(tc[1])),
    )


def predict_decode_step(c: Candidate, block_size: int, num_prompt_tokens: int) -> float:
    """Seconds until a request with this prompt has decoded its first step on `c`: its KV
    pushed behind the KV already on the way there, then `c`'s step with it in the batch, KV
    pressure included (its blocks must be reserved before the prompt's KV is pushed)."""
    n = max(1, num_prompt_tokens)
    push = (c.incoming_kv_tokens + n) * c.fetch_s_per_token
    return push + _joined_step(c) + _pressure(c, -(-n // block_size))


def _joined_step(c: Candidate) -> float:
    """`c`'s step once one more request joins its batch."""
    return c.step_s + (c.num_requests + 1) * c.step_s_per_seq


def _pressure(c: Candidate, needed_blocks: int) -> float:
    """The wait for memory when `needed_blocks` exceed the free ones (module docstring)."""
    if c.num_total_blocks <= 0 or needed_blocks <= c.num_free_blocks:
        return 0.0
    deficit = (needed_blocks - c.num_free_blocks) / c.num_total_blocks
    return deficit * PRESSURE_HORIZON_STEPS * c.step_s


def _split(c: Candidate, block_size: int, num_prompt_tokens: int) -> tuple[int, int, int]:
    """(all, fetched, computed) tokens of a prompt of `num_prompt_tokens` on `c`."""
    n = max(1, num_prompt_tokens)
    local = min(n, c.prefix_blocks * block_size)
    store = max(0, min(n, c.store_blocks * block_size) - local)
    return n, store, max(1, n - local - store)


def fetched_tokens(c: Candidate, block_size: int, num_prompt_tokens: int) -> int:
    """The prompt tokens `c` would fetch from the kvstore."""
    return _split(c, block_size, num_prompt_tokens)[1]


def uncached_tokens(c: Candidate, block_size: int, num_prompt_tokens: int) -> int:
    """The prompt tokens `c` would compute: not in its prefix cache, not in the kvstore (at
    least the last token)."""
    return _split(c, block_size, num_prompt_tokens)[2]


def imposed_delay(
    c: Candidate, block_size: int, num_prompt_tokens: int, arrival_rate: float
) -> float:
    """What computing the prompt on `c` adds to the TTFT of the requests that queue behind it,
    with requests arriving at `c` at `arrival_rate` per second (module docstring)."""
    _, _, compute = _split(c, block_size, num_prompt_tokens)
    compute_s = compute * c.prefill_s_per_token
    return compute_s * (c.num_queued + arrival_rate * compute_s / 2)


def predict_ttft(c: Candidate, block_size: int, num_prompt_tokens: int) -> float:
    """Seconds to the first token of a prompt of `num_prompt_tokens` on `c` (module docstring)."""
    n, store, compute = _split(c, block_size, num_prompt_tokens)
    prompt = c.queued_prompt_tokens + compute
    steps = 1
    if c.step_token_budget > 0:
        room = max(1, c.step_token_budget - c.num_requests)
        steps = max(1, -(-prompt // room))
    fetch = (c.incoming_kv_tokens + store) * c.fetch_s_per_token if store else 0.0
    ttft = steps * _joined_step(c) + prompt * c.prefill_s_per_token + fetch
    blocks = -(-n // block_size)
    return ttft + _pressure(c, blocks - min(c.prefix_blocks, blocks))


def make_policy(
    name: str, prefix_load_threshold: int = 4, clock: Callable[[], float] = time.monotonic
) -> Policy:
    if name == RoundRobin.name:
        return RoundRobin()
    if name == LeastLoad.name:
        return LeastLoad()
    if name == PrefixAware.name:
        return PrefixAware(prefix_load_threshold)
    if name == PredictedTTFT.name:
        return PredictedTTFT(clock)
    raise ValueError(f"unknown routing policy {name!r}")
