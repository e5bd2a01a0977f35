"""`llmfleet bench serve`: build the dataset, drive the requests, report and save.

    outcome = serve(args)        # args from `llmfleet bench serve`'s parser
    outcome.metrics.completed, outcome.json_path, outcome.plot_paths

The clock (`t0`) starts after any warm-up requests; every request is a task that sleeps until
its arrival time (`arrival.arrival_times`), then, with `--max-concurrency`, waits for a slot,
then sends. The duration ends when the last response has ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmfleet.cli.benchserve import datasets
from llmfleet.cli.benchserve.arrival import arrival_times
from llmfleet.cli.benchserve.backends import Backend, GrpcBackend, OpenAIBackend
from llmfleet.cli.benchserve.datasets import SampleRequest
from llmfleet.cli.benchserve.plots import plot_distributions, plot_timeline
from llmfleet.cli.benchserve.report import (
    RunInfo,
    default_result_filename,
    format_report,
    result_json,
)
from llmfleet.cli.benchserve.stats import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    parse_goodput,
    parse_metrics,
    parse_percentiles,
)
from llmfleet.shared.core.errors import ValidationError

logger = logging.getLogger(__name__)


@dataclass
class ServeOutcome:
    """One finished benchmark: what `serve` printed and wrote."""

    info: RunInfo
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    report: str
    json_path: Path | None = None
    plot_paths: list[Path] = field(default_factory=list)


async def run_requests(
    backend: Backend,
    requests: Sequence[SampleRequest],
    times: Sequence[float],
    *,
    max_concurrency: int | None = None,
    disable_tqdm: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send `requests[i]` at `times[i]` seconds from now; returns (records, duration in s)."""
    from tqdm import tqdm

    records = [
        RequestRecord(i, r.prompt_len, r.expected_output_len) for i, r in enumerate(requests)
    ]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=disable_tqdm, unit="req", desc="bench serve")
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + times[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        records[i].scheduled_s = time.perf_counter() - t0
        if slots is None:
            await backend.send(requests[i], records[i], t0)
        else:
            async with slots:
                await backend.send(requests[i], records[i], t0)
        bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        bar.close()
    return records, time.perf_counter() - t0


def _validate(args: argparse.Namespace) -> None:
    if args.backend != "grpc" and not args.base_url:
        raise ValidationError("--base-url", f"is required with --backend {args.backend}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValidationError("--max-concurrency", f"must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValidationError("--num-warmups", f"must be >= 0, got {args.num_warmups}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValidationError("--dataset-path", "is required with --dataset-name sharegpt")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValidationError("--request-timeout", f"must be > 0, got {args.request_timeout}")


def _backend(args: argparse.Namespace) -> Backend:
    common: dict[str, Any] = {
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "timeout_s": args.request_timeout,
        "api_key": args.api_key,
    }
    if args.backend == "grpc":
        return GrpcBackend(args.endpoint, **common)
    return OpenAIBackend(
        args.base_url,
        chat=args.backend == "openai-chat",
        model=args.model,
        endpoint_path=args.endpoint_path,
        max_connections=args.max_concurrency,
        **common,
    )


def load_tokenizer(path: str | None, vocab_limit: int | None) -> datasets.HFTokenizer:
    """The served model's tokenizer (loads `transformers`; a GGUF one is cached once built)."""
    from llmfleet.text.loading import load_tokenizer as load_hf

    return datasets.HFTokenizer(load_hf(path), vocab_limit)


def build_requests(
    args: argparse.Namespace, tokenizer: datasets.Tokenizer, *, as_text: bool
) -> list[SampleRequest]:
    """The dataset `args` describe (warm-up requests first, then the timed ones)."""
    n = args.num_prompts + args.num_warmups
    if args.dataset_name == "random":
        return datasets.random_requests(
            tokenizer,
            num_prompts=n,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
            as_text=as_text,
        )
    if args.dataset_name == "prefix-repetition":
        return datasets.prefix_repetition_requests(
            tokenizer,
            num_prompts=n,
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
            seed=args.seed,
            as_text=as_text,
        )
    return datasets.sharegpt_requests(
        tokenizer,
        args.dataset_path,
        num_prompts=n,
        output_len=args.sharegpt_output_len,
        seed=args.seed,
    )


async def _run(args: argparse.Namespace) -> tuple[RunInfo, list[RequestRecord], float]:
    backend = _backend(args)
    try:
        model_id, vocab_limit = await backend.model()
        tokenizer = load_tokenizer(args.tokenizer, vocab_limit)
        requests = build_requests(args, tokenizer, as_text=args.backend != "grpc")
        warmups, timed = requests[: args.num_warmups], requests[args.num_warmups :]
        if warmups:
            logger.info("%d warm-up requests", len(warmups))
            await run_requests(backend, warmups, [0.0] * len(warmups), disable_tqdm=True)
        times = arrival_times(len(timed), args.request_rate, args.burstiness, args.seed)
        records, duration = await run_requests(
            backend,
            timed,
            times,
            max_concurrency=args.max_concurrency,
            disable_tqdm=args.disable_tqdm,
        )
    finally:
        await backend.close()
    info = RunInfo(
        backend=args.backend,
        target=backend.target,
        model_id=model_id,
        tokenizer=args.tokenizer or "bundled",
        dataset=args.dataset_name,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
    )
    return info, records, duration


def serve(args: argparse.Namespace) -> ServeOutcome:
    """Run the benchmark `args` describe; print the report to stdout; save when asked."""
    _validate(args)
    metric_names = parse_metrics(args.percentile_metrics)
    qs = parse_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput or [])
    arrival_times(0, args.request_rate, args.burstiness)  # argument check before any work
    info, records, duration = asyncio.run(_run(args))
    metrics = compute_metrics(records, duration, qs, slos)
    report = format_report(metrics, info, metric_names)
    print(report, flush=True)
    for r in records:
        if not r.success:
            logger.warning("request %d failed: %s", r.index, r.error)
            break  # one example is enough on the terminal; the JSON holds them all
    outcome = ServeOutcome(info, metrics, records, report)
    if args.save_result:
        save(outcome, Path(args.result_dir), args.result_filename, plots=not args.no_plots)
    return outcome


def save(outcome: ServeOutcome, result_dir: Path, filename: str | None, *, plots: bool) -> None:
    """Write the JSON result (and the two PNG plots) into `result_dir`."""
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / (filename or default_result_filename(outcome.info))
    data = result_json(outcome.metrics, outcome.info, outcome.records)
    # JSON has no infinity: an unlimited rate is written as the string "inf".
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    outcome.json_path = path
    logger.info("results written to %s", path)
    if plots:
        title = f"{outcome.info.backend} {outcome.info.dataset}, {outcome.info.model_id}"
        stem = path.with_suffix("")
        outcome.plot_paths = [
            plot_timeline(outcome.records, Path(f"{stem}.timeline.png"), title),
            plot_distributions(outcome.records, Path(f"{stem}.latency.png"), title),
        ]
        logger.info("plots written: %s", ", ".join(map(str, outcome.plot_paths)))


def main(args: argparse.Namespace) -> int:
    """`llmfleet bench serve`; exit status 0 when every request succeeded, else 1."""
    outcome = serve(args)
    return 0 if outcome.metrics.failed == 0 else 1
