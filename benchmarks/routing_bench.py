"""Prefix-aware routing vs round robin: TTFT on the prefix-repetition dataset, one run.

    make bench-serve        # this program (also part of `make bench`)
    .venv/bin/python benchmarks/routing_bench.py [--num-prompts 32] [--kvstore] ...

For each policy (prefix_aware, then round_robin) it starts a fleet of two unified workers on
this machine (the bundled SmolLM2 unless --model) and runs `llmfleet bench serve` over gRPC with
the same prefix-repetition prompts and the same arrival schedule (same seed), then prints both
TTFT summaries side by side with the round-robin / prefix-aware ratio.

What makes the policies differ: a prompt whose prefix is cached on the worker it lands on is
prefilled from its suffix alone. Prefix-aware routing sends prompts sharing a prefix to the
same worker; round robin spreads them over both, so each worker computes each prefix itself
and, with a KV cache too small for every prefix (--num-kv-blocks), evicts prefixes it will
need again. The shared kvstore is off by default: with it, a worker that misses fetches the
prefix's KV from the store instead of recomputing it, which hides most of the routing
difference (run with --kvstore to see that).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from llmfleet.shared.benchserve.runner import ServeOutcome, serve
from llmfleet.shared.cli import build_parser
from llmfleet.shared.launcher import Fleet, FleetSpec

POLICIES = ("prefix_aware", "round_robin")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--max-concurrency", type=int, default=2)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=96,
        help="KV blocks (of 16 tokens) per worker: room for 5 of the 8 default prefixes",
    )
    ap.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--kvstore", action="store_true", help="run with the shared KV store")
    ap.add_argument("--result-dir", default=None, help="also save each run's JSON and plots")
    return ap.parse_args()


def run_policy(args: argparse.Namespace, policy: str) -> ServeOutcome:
    spec = FleetSpec(
        port=0,
        workers=2,
        model=args.model,
        routing_policy=policy,
        kvstore=args.kvstore,
        extra_args={"worker": ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16"]},
        env={"LLMFLEET_NUM_THREADS": str(args.worker_threads)},
    )
    with Fleet(spec) as fleet:
        argv = [
            *("bench", "serve", "--endpoint", fleet.endpoint, "--disable-tqdm"),
            *("--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts)),
            *("--prefix-repetition-prefix-len", str(args.prefix_len)),
            *("--prefix-repetition-suffix-len", str(args.suffix_len)),
            *("--prefix-repetition-num-prefixes", str(args.num_prefixes)),
            *("--prefix-repetition-output-len", str(args.output_len)),
            *("--max-concurrency", str(args.max_concurrency)),
            *("--request-rate", str(args.request_rate), "--seed", str(args.seed)),
            *("--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "99"),
        ]
        if args.model is not None:
            argv += ["--tokenizer", args.model]
        if args.result_dir is not None:
            argv += ["--save-result", "--result-dir", args.result_dir]
            argv += ["--result-filename", f"routing-{policy}.json"]
        print(f"\n## routing policy {policy}", flush=True)
        outcome = serve(build_parser().parse_args(argv))
    if outcome.metrics.failed:
        raise SystemExit(f"{policy}: {outcome.metrics.failed} requests failed")
    return outcome


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    results = {policy: run_policy(args, policy) for policy in POLICIES}
    pa, rr = (results[p].metrics for p in POLICIES)
    print(
        f"\n# llmfleet routing bench — {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores; 2 unified workers ({args.worker_threads} torch thread each, "
        f"{args.num_kv_blocks} KV blocks each), kvstore {'on' if args.kvstore else 'off'}; "
        f"prefix-repetition: {args.num_prompts} prompts, {args.num_prefixes} prefixes of "
        f"{args.prefix_len} tokens + {args.suffix_len}-token suffixes, {args.output_len} output "
        f"tokens; max concurrency {args.max_concurrency}, request rate {args.request_rate:g}; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print("| metric | prefix_aware | round_robin | round_robin / prefix_aware |")
    print("|---|---|---|---|")
    rows = [
        ("mean TTFT (ms)", pa.distributions["ttft"].mean, rr.distributions["ttft"].mean),
        ("median TTFT (ms)", pa.distributions["ttft"].median, rr.distributions["ttft"].median),
        (
            "P99 TTFT (ms)",
            pa.distributions["ttft"].percentiles[99.0],
            rr.distributions["ttft"].percentiles[99.0],
        ),
        ("mean E2EL (ms)", pa.distributions["e2el"].mean, rr.distributions["e2el"].mean),
        ("output tok/s", pa.output_throughput, rr.output_throughput),
    ]
    for name, a, b in rows:
        ratio = f"{b / a:.2f}x" if a > 0 else "—"
        print(f"| {name} | {a:.1f} | {b:.1f} | {ratio} |")
    cached = [m.total_cached_tokens / max(m.total_input_tokens, 1) for m in (pa, rr)]
    print(f"| prompt tokens found in a prefix cache | {cached[0]:.0%} | {cached[1]:.0%} | |")


if __name__ == "__main__":
    main()
