"""The benchmark's text report (stdout) and its JSON result (all aggregates + per request)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmfleet.cli.benchserve.stats import METRIC_TITLES, BenchmarkMetrics, RequestRecord

_WIDTH = 50
_LABEL = 40


@dataclass(frozen=True)
class RunInfo:
    """What was run: shown in the report's header and stored in the JSON result."""

    backend: str  # "grpc" | "openai" | "openai-chat"
    target: str  # gRPC endpoint or base URL
    model_id: str
    tokenizer: str
    dataset: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int


def _fmt_q(q: float) -> str:
    return f"{q:g}"


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<{_LABEL}}{value}"


def _rule(title: str = "", char: str = "-") -> str:
    return f"{title:{char}^{_WIDTH}}"


def format_report(
    metrics: BenchmarkMetrics, info: RunInfo, percentile_metrics: Sequence[str]
) -> str:
    """The human-readable summary, one `label value` line each, ruled sections per metric."""
    m = metrics
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _line("Backend:", f"{info.backend} ({info.target})"),
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Request rate configured (req/s):", info.request_rate),
    ]
    if info.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", info.max_concurrency))
    lines += [
        _line("Benchmark duration (s):", m.duration_s),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Prefix-cached input tokens:", m.total_cached_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput))
    lines += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_token_throughput),
        _line("Peak concurrent requests:", m.peak_concurrency),
    ]
    for name in percentile_metrics:
        d = m.distributions[name]
        short = name.upper()
        lines += [
            _rule(METRIC_TITLES[name]),
            _line(f"Mean {short} (ms):", d.mean),
            _line(f"Median {short} (ms):", d.median),
        ]
        lines += [_line(f"P{_fmt_q(q)} {short} (ms):", v) for q, v in d.percentiles.items()]
    lines.append(_rule(char="="))
    return "\n".join(lines)


def result_json(
    metrics: BenchmarkMetrics,
    info: RunInfo,
    records: Sequence[RequestRecord],
) -> dict[str, Any]:
    """Everything reported, flat (`mean_ttft_ms`, `p99_itl_ms`, ...), plus per-request arrays
    in dataset order (`ttfts`/`itls`/`e2els` in seconds, as the records hold them)."""
    m = metrics
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "backend": info.backend,
        "target": info.target,
        "model_id": info.model_id,
        "tokenizer": info.tokenizer,
        "dataset": info.dataset,
        "num_prompts": info.num_prompts,
        "request_rate": info.request_rate if info.request_rate != float("inf") else "inf",
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "seed": info.seed,
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "total_cached_tokens": m.total_cached_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "goodput_slos_ms": m.goodput_slos,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "peak_concurrency": m.peak_concurrency,
    }
    for name, d in m.distributions.items():
        out[f"mean_{name}_ms"] = d.mean
        out[f"median_{name}_ms"] = d.median
        out[f"std_{name}_ms"] = d.std
        for q, v in d.percentiles.items():
            out[f"p{_fmt_q(q)}_{name}_ms"] = v
    ordered = sorted(records, key=lambda r: r.index)
    out.update(
        {
            "input_lens": [r.prompt_len for r in ordered],
            "output_lens": [r.output_tokens for r in ordered],
            "cached_lens": [r.cached_tokens for r in ordered],
            "expected_output_lens": [r.expected_output_len for r in ordered],
            "scheduled_times": [r.scheduled_s for r in ordered],
            "start_times": [r.start_s for r in ordered],
            "ttfts": [r.ttft_s for r in ordered],
            "itls": [r.itl_s for r in ordered],
            "e2els": [r.latency_s for r in ordered],
            "success": [r.success for r in ordered],
            "errors": [r.error for r in ordered],
        }
    )
    return out


def default_result_filename(info: RunInfo) -> str:
    """e.g. `grpc-4qps-concurrency8-SmolLM2-135M-Instruct-20261121-101500.json`."""
    rate = "inf" if info.request_rate == float("inf") else f"{info.request_rate:g}"
    conc = f"-concurrency{info.max_concurrency}" if info.max_concurrency is not None else ""
    model = info.model_id.rsplit("/", 1)[-1] or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return f"{info.backend}-{rate}qps{conc}-{safe}-{time.strftime('%Y%m%d-%H%M%S')}.json"
