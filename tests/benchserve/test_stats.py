"""Statistics: percentiles against numpy, TPOT, goodput on crafted records, totals."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmfleet.cli.benchserve.stats import (
    Distribution,
    RequestRecord,
    compute_metrics,
    meets_slos,
    parse_goodput,
    parse_metrics,
    parse_percentiles,
    peak_concurrency,
    percentile,
)
from llmfleet.shared.core.errors import ValidationError


def rec(i, *, ttft, latency, out, start=0.0, itl=(), prompt=10, ok=True) -> RequestRecord:
    return RequestRecord(
        index=i,
        prompt_len=prompt,
        expected_output_len=out,
        start_s=start,
        ttft_s=ttft,
        itl_s=list(itl),
        latency_s=latency,
        output_tokens=out if ok else 0,
        success=ok,
        error="" if ok else "boom",
    )


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(n):
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)


def test_distribution_in_ms_matches_numpy():
    values = [0.010, 0.030, 0.020, 0.100]
    d = Distribution.of(values, [90.0, 99.0])
    ms = np.array(values) * 1e3
    assert d.mean == pytest.approx(ms.mean())
    assert d.median == pytest.approx(np.median(ms))
    assert d.std == pytest.approx(ms.std())
    assert d.percentiles[99.0] == pytest.approx(np.percentile(ms, 99))
    assert Distribution.of([], [99.0]) == Distribution(0.0, 0.0, 0.0, {99.0: 0.0})


def test_tpot_excludes_the_first_token():
    assert rec(0, ttft=0.1, latency=1.0, out=10).tpot_s == pytest.approx(0.1)
    assert rec(0, ttft=0.1, latency=1.0, out=1).tpot_s is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0, ttft=0.05, latency=0.5, out=10),  # tpot 50 ms: good
        rec(1, ttft=0.30, latency=0.6, out=10),  # ttft over 200 ms
        rec(2, ttft=0.05, latency=2.0, out=10),  # tpot 216 ms
        rec(3, ttft=0.10, latency=0.1, out=1),  # one token: tpot counts as 0, good
        rec(4, ttft=0.01, latency=0.2, out=5, ok=False),  # failed never counts
    ]
    slos = parse_goodput(["ttft:200 tpot:60"])
    assert slos == {"ttft": 200.0, "tpot": 60.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    m = compute_metrics(records, duration_s=2.0, goodput_slos=slos)
    assert m.request_goodput == pytest.approx(1.0)  # 2 good requests / 2 s
    assert compute_metrics(records, 2.0, goodput_slos={"e2el": 550}).request_goodput == 1.0
    assert compute_metrics(records, 2.0).request_goodput is None


def test_totals_and_throughputs_count_successes_only():
    records = [
        rec(0, ttft=0.1, latency=0.5, out=5, itl=[0.1] * 4, prompt=20),
        rec(1, ttft=0.3, latency=0.7, out=3, itl=[0.2, 0.2], prompt=30, start=0.2),
        rec(2, ttft=0.0, latency=0.1, out=4, prompt=50, ok=False),
    ]
    m = compute_metrics(records, duration_s=1.0, percentiles=[50.0])
    assert (m.num_requests, m.completed, m.failed) == (3, 2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (50, 8)
    assert m.request_throughput == 2.0 and m.output_throughput == 8.0
    assert m.total_token_throughput == 58.0
    assert m.distributions["ttft"].mean == pytest.approx(200.0)
    assert m.distributions["itl"].median == pytest.approx(100.0)
    assert m.distributions["e2el"].percentiles[50.0] == pytest.approx(600.0)
    assert m.peak_concurrency == 2


def test_peak_concurrency_treats_touching_intervals_as_sequential():
    a = rec(0, ttft=0.1, latency=1.0, out=2, start=0.0)
    b = rec(1, ttft=0.1, latency=1.0, out=2, start=1.0)
    c = rec(2, ttft=0.1, latency=0.5, out=2, start=0.2)
    assert peak_concurrency([a, b]) == 1
    assert peak_concurrency([a, b, c]) == 2


@pytest.mark.parametrize(
    ("parse", "arg", "field"),
    [
        (parse_goodput, ["ttft=5"], "--goodput"),
        (parse_goodput, ["itl:5"], "--goodput"),
        (parse_goodput, ["ttft:-1"], "--goodput"),
        (parse_goodput, ["ttft:fast"], "--goodput"),
        (parse_percentiles, "90,x", "--metric-percentiles"),
        (parse_percentiles, "101", "--metric-percentiles"),
        (parse_metrics, "ttft,foo", "--percentile-metrics"),
    ],
)
def test_bad_metric_arguments_name_the_flag(parse, arg, field):
    with pytest.raises(ValidationError) as e:
        parse(arg)
    assert e.value.field == field
