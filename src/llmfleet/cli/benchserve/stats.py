"""Per-request benchmark records and the aggregates reported from them.

Definitions (as serving benchmarks commonly report them; all latencies client-side):
- TTFT: send → first token chunk received.
- ITL: gap between consecutive token chunks of one request (a chunk may carry several tokens).
- TPOT: (E2EL − TTFT) / (output tokens − 1), per request with more than one output token.
- E2EL: send → last byte of the response.
- throughputs divide by the benchmark's wall-clock duration (first arrival → last response).
- goodput: successful requests per second meeting every given SLO (TTFT, TPOT, E2EL in ms).
Percentiles interpolate linearly between closest ranks (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmfleet.shared.core.errors import ValidationError

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `*_s` offsets are from the benchmark start.

    Invariants for a successful request: scheduled_s <= start_s; ttft_s <= latency_s;
    len(itl_s) == number of token chunks - 1; start_s + ttft_s + sum(itl_s) <= start_s +
    latency_s (the last chunk arrives before the response ends).
    """

    index: int  # position in the dataset
    prompt_len: int  # prompt tokens (the server's usage count when it reports one)
    expected_output_len: int  # max_tokens asked for
    scheduled_s: float = 0.0  # when the arrival schedule released it
    start_s: float = 0.0  # when it was sent (later than scheduled_s while at max concurrency)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int = 0  # generated tokens (usage; else counted from the stream)
    success: bool = False
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server found in a prefix cache (usage)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValidationError("--metric-percentiles", f"must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float  # population standard deviation
    percentiles: dict[float, float]  # q -> value

    @classmethod
    def of(cls, values_s: Sequence[float], qs: Sequence[float]) -> Distribution:
        ms = [v * 1e3 for v in values_s]
        if not ms:
            return cls(0.0, 0.0, 0.0, {q: 0.0 for q in qs})
        mean = math.fsum(ms) / len(ms)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in ms) / len(ms))
        return cls(mean, percentile(ms, 50.0), std, {q: percentile(ms, q) for q in qs})


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` (also one space-separated string) -> {"ttft": 200.0, ...}."""
    slos: dict[str, float] = {}
    for item in (part for s in items for part in s.split()):
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValidationError(
                "--goodput", f"expected METRIC:MS with METRIC one of {GOODPUT_METRICS}: {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValidationError("--goodput", f"{name}: not a number: {value!r}") from None
        if not ms > 0:
            raise ValidationError("--goodput", f"{name}: must be > 0 ms, got {value}")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"90,99"` -> [90.0, 99.0]."""
    try:
        qs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValidationError("--metric-percentiles", f"not numbers: {text!r}") from None
    if not qs:
        raise ValidationError("--metric-percentiles", "give at least one percentile")
    for q in qs:
        percentile([], q)  # range check
    return qs


def parse_metrics(text: str) -> list[str]:
    """`"ttft,itl"` -> ["ttft", "itl"]; each one of METRICS."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValidationError("--percentile-metrics", f"choose from {METRICS}, got {text!r}")
    return names


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a successful record meets every SLO (ms). TPOT counts as 0 with < 2 tokens."""
    if not record.success:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.latency_s}
    return all(values[name] * 1e3 <= limit for name, limit in slos.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (sent, not yet answered)."""
    events = sorted(
        [(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records],
        key=lambda e: (e[0], e[1]),  # at equal times, an end before a start
    )
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The aggregates of one run (see the module docstring for definitions)."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int  # prompt tokens served from a prefix cache (0: not reported)
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    goodput_slos: dict[str, float]
    request_goodput: float | None  # None when no SLO was given
    distributions: dict[str, Distribution]  # metric name -> summary (ms)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    goodput_slos: Mapping[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregates over `records`; token totals and latencies count successful requests only."""
    ok = [r for r in records if r.success]
    values: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    slos = dict(goodput_slos or {})
    goodput = sum(meets_slos(r, slos) for r in ok) * per_s if slos else None
    return BenchmarkMetrics(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) * per_s,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        peak_concurrency=peak_concurrency(ok),
        goodput_slos=slos,
        request_goodput=goodput,
        distributions={m: Distribution.of(values[m], percentiles) for m in METRICS},
    )
