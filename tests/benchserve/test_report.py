"""Report text, JSON result and PNG plots from crafted records."""

from __future__ import annotations

import json

import pytest

from llmfleet.cli.benchserve.plots import plot_distributions, plot_timeline, segments
from llmfleet.cli.benchserve.report import (
    RunInfo,
    default_result_filename,
    format_report,
    result_json,
)
from llmfleet.cli.benchserve.stats import RequestRecord, compute_metrics

INFO = RunInfo(
    backend="grpc",
    target="127.0.0.1:1",
    model_id="org/Tiny-Model",
    tokenizer="bundled",
    dataset="random",
    num_prompts=3,
    request_rate=float("inf"),
    burstiness=1.0,
    max_concurrency=2,
    seed=0,
)


def records() -> list[RequestRecord]:
    return [
        RequestRecord(1, 8, 4, 0.0, 0.5, 0.2, [0.1, 0.1, 0.1], 0.55, 4, True),
        RequestRecord(0, 8, 4, 0.0, 0.0, 0.1, [0.1, 0.1, 0.1], 0.45, 4, True),
        RequestRecord(2, 8, 4, 0.1, 0.5, 0.0, [], 0.05, 0, False, "UNAVAILABLE: gone"),
    ]


def test_report_lists_the_aggregates_with_their_values():
    m = compute_metrics(records(), 1.0, [90.0, 99.0], {"ttft": 150.0})
    text = format_report(m, INFO, ["ttft", "itl", "e2el"])
    lines = dict(
        (line[:40].strip(), line[40:].strip()) for line in text.splitlines() if ":" in line[:40]
    )
    assert lines["Successful requests:"] == "2"
    assert lines["Failed requests:"] == "1"
    assert lines["Maximum request concurrency:"] == "2"
    assert lines["Total generated tokens:"] == "8"
    assert lines["Request throughput (req/s):"] == "2.00"
    assert lines["Request goodput (req/s):"] == "1.00"  # request 0 only has TTFT <= 150 ms
    assert lines["Output token throughput (tok/s):"] == "8.00"
    assert lines["Mean TTFT (ms):"] == "150.00"
    assert lines["P99 ITL (ms):"] == "100.00"
    assert "Median E2EL (ms):" in lines and "Mean TPOT (ms):" not in lines
    assert "Time to First Token" in text and "Time per Output Token" not in text


def test_result_json_has_aggregates_and_per_request_arrays_in_dataset_order():
    m = compute_metrics(records(), 1.0, [90.0, 99.0])
    data = json.loads(json.dumps(result_json(m, INFO, records()), allow_nan=False))
    assert data["request_rate"] == "inf" and data["completed"] == 2
    assert data["total_output_tokens"] == 8
    assert data["mean_ttft_ms"] == pytest.approx(150.0)
    assert {"p90_itl_ms", "p99_e2el_ms", "std_tpot_ms", "median_tpot_ms"} <= set(data)
    assert data["ttfts"] == [0.1, 0.2, 0.0]
    assert data["output_lens"] == [4, 4, 0]
    assert data["errors"] == ["", "", "UNAVAILABLE: gone"]
    assert data["itls"][0] == [0.1, 0.1, 0.1]
    name = default_result_filename(INFO)
    assert name.startswith("grpc-infqps-concurrency2-Tiny-Model-") and name.endswith(".json")


def test_timeline_segments_follow_the_request():
    ok, _, failed = records()
    segs = segments(ok)
    assert [round(s, 6) for s, _, _ in segs] == [0.0, 0.5, 0.7, 0.8, 0.9, 1.0]
    assert segs[0][1] == pytest.approx(0.5)  # waited for a slot
    assert segs[1][1] == pytest.approx(0.2)  # TTFT
    assert sum(w for _, w, _ in segs[1:]) == pytest.approx(ok.latency_s)
    assert len(segments(failed)) == 2  # queue, then the failure


def test_plots_are_png_files(tmp_path):
    for plot, name in ((plot_timeline, "t.png"), (plot_distributions, "d.png")):
        path = plot(records(), tmp_path / name, "test")
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    empty = plot_distributions([], tmp_path / "empty.png")
    assert empty.stat().st_size > 1000
