"""The Grafana dashboard (deploy/grafana/llmfleet-dashboard.json) reads only metrics we export
and covers what operators look at: latency percentiles, throughput, KV cache, kvstore, KV
transfer and utilization against templated peaks."""

from __future__ import annotations

import pytest
from promql import (
    dashboard_exprs,
    dashboard_metric_names,
    exported_names,
    load_dashboard,
    metric_names,
    panels,
)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(vllm:ttft_bucket{model_name=~"$m"}'
            "[$__rate_interval])))",
            {"vllm:ttft_bucket"},
        ),
        (
            "sum(rate(a:hits_total[5m])) / sum(rate(a:queries_total[5m]))",
            {"a:hits_total", "a:queries_total"},
        ),
        ("sum by (instance, device) (rate(x:flops_total[1m])) / $peak_flops", {"x:flops_total"}),
        (
            'max without (le) (up{job="a b"} offset 5m) > bool 3 unless on (job) down',
            {"up", "down"},
        ),
        ('label_replace(rate(m_total[1m]), "dst", "$1", "src", "(.*)")', {"m_total"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names


def test_every_metric_the_dashboard_reads_is_exported():
    used = dashboard_metric_names()
    missing = used - exported_names()
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"


def test_a_misspelt_metric_would_be_caught():
    assert "vllm:num_request_running" not in exported_names()
    assert metric_names("sum(vllm:num_request_running)") == {"vllm:num_request_running"}


def test_the_dashboard_covers_latency_throughput_cache_transfer_and_utilization():
    dash = load_dashboard()
    exprs = dashboard_exprs(dash)
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        quantiles = [e for e in exprs if f"{hist}_bucket" in e and "histogram_quantile" in e]
        assert len(quantiles) == 3, hist  # p50, p90, p99
    used = dashboard_metric_names()
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "llmfleet:kvstore_hits_total",
        "llmfleet:kvstore_bytes",
        "llmfleet:kv_transfer_bytes_total",
        "llmfleet:kv_transfer_seconds_bucket",
    ):
        assert name in used, name
    assert any("llmfleet:estimated_flops_total" in e and "$peak_flops" in e for e in exprs)
    assert any("llmfleet:estimated_read_bytes_total" in e and "$peak_bandwidth" in e for e in exprs)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for peak in ("peak_flops", "peak_bandwidth"):
        assert float(variables[peak]["query"]) > 0, peak
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        if p["type"] != "row":
            assert p.get("targets") and all(t["expr"].strip() for t in p["targets"]), p["title"]
