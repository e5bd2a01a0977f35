"""Arrival schedules: Poisson rate, gamma burstiness, all-at-once, argument checks."""

from __future__ import annotations

import math
import statistics

import pytest

from llmfleet.cli.benchserve.arrival import arrival_times
from llmfleet.shared.core.errors import ValidationError


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_poisson_schedule_has_the_requested_mean_rate():
    times = arrival_times(20_000, request_rate=4.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = _gaps(times)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_scales_the_variation(burstiness):
    gaps = _gaps(arrival_times(20_000, request_rate=2.0, burstiness=burstiness, seed=1))
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_sends_everything_at_once_and_seed_repeats():
    assert arrival_times(5, float("inf")) == [0.0] * 5
    assert arrival_times(50, 3.0, seed=7) == arrival_times(50, 3.0, seed=7)
    assert arrival_times(50, 3.0, seed=7) != arrival_times(50, 3.0, seed=8)


@pytest.mark.parametrize(
    ("rate", "burstiness", "field"),
    [(0.0, 1.0, "--request-rate"), (math.nan, 1.0, "--request-rate"), (1.0, 0.0, "--burstiness")],
)
def test_bad_arguments_name_the_flag(rate, burstiness, field):
    with pytest.raises(ValidationError) as e:
        arrival_times(3, rate, burstiness)
    assert e.value.field == field
