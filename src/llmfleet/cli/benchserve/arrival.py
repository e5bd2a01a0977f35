"""When each benchmark request arrives: a Poisson (or gamma) process, or all at once.

The first request arrives at t = 0; the gaps between consecutive arrivals are independent
draws from a gamma distribution with shape `burstiness` and mean 1/`request_rate`:
- burstiness 1: exponential gaps, i.e. a Poisson process of rate `request_rate`;
- burstiness < 1: burstier (more variance: gaps' coefficient of variation is 1/sqrt(b));
- burstiness > 1: more regular, approaching a fixed interval.
`request_rate` inf sends everything at t = 0. Fixed concurrency (`--max-concurrency`) is
applied by the runner on top of this schedule: a request that arrives while that many are in
flight waits for one to finish.
"""

from __future__ import annotations

import math
import random

from llmfleet.shared.core.errors import ValidationError


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Arrival offsets in seconds from the benchmark's start: nondecreasing, the first 0."""
    if num_requests < 0:
        raise ValidationError("--num-prompts", f"must be >= 0, got {num_requests}")
    if not request_rate > 0:  # also rejects NaN
        raise ValidationError("--request-rate", f"must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValidationError("--burstiness", f"must be a positive number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    times: list[float] = []
    t = 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times
