"""Routing policies side by side: TTFT on the prefix-repetition dataset, one run.

    make bench-serve        # this program (also part of `make bench`)
    .venv/bin/python benchmarks/routing_bench.py [--num-prompts 32] [--repeats 2] [--kvstore]
        [--policies predicted_ttft prefix_aware round_robin]

It starts one fleet of two unified workers per policy on this machine (the bundled SmolLM2
unless --model) and runs `llmfleet bench serve` over gRPC with prefix-repetition prompts
against each. Run i (of --repeats) sends the same prompts (seed + i: fresh prefixes every run)
with the same arrival schedule to every fleet, one after the other, the order rotating from
run to run, so a slow drift in the load of a shared machine weighs on every policy alike. It
prints each run's report, then the policies' TTFT over all runs side by side with how each
compares to round robin (round robin's time / the policy's, the policy's throughput / round
robin's: above 1x, better).

What makes the policies differ: a prompt whose prefix is cached on the worker it lands on is
prefilled from its suffix alone. Prefix-aware routing sends prompts sharing a prefix to the
same worker; round robin spreads them over both, so each worker computes each prefix itself
and, with a KV cache too small for every prefix (--num-kv-blocks), evicts prefixes it will
need again. The shared kvstore is off by default: with it, a worker that misses fetches the
prefix's KV from the store instead of recomputing it, which hides much of the routing
difference (run with --kvstore to see that).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from contextlib import ExitStack

from llmfleet.cli.benchserve.runner import serve
from llmfleet.cli.benchserve.stats import BenchmarkMetrics, RequestRecord, compute_metrics
from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.parser import build_parser

POLICIES = ("predicted_ttft", "prefix_aware", "round_robin")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--num-prompts", type=int, default=32, help="per run and policy")
    ap.add_argument("--repeats", type=int, default=2, help="runs per policy (alternating order)")
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
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="round_robin included")
    ap.add_argument("--result-dir", default=None, help="also save each run's JSON and plots")
    return ap.parse_args()


def fleet_spec(args: argparse.Namespace, policy: str) -> FleetSpec:
    return FleetSpec(
        port=0,
        workers=2,
        model=args.model,
        routing_policy=policy,
        kvstore=args.kvstore,
        extra_args={"worker": ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16"]},
        env={"LLMFLEET_NUM_THREADS": str(args.worker_threads)},
    )


def bench_argv(args: argparse.Namespace, endpoint: str, policy: str, run: int) -> list[str]:
    """`llmfleet bench serve` arguments of one run against one fleet."""
    argv = [
        *("bench", "serve", "--endpoint", endpoint, "--disable-tqdm"),
        *("--dataset-name", "prefix-repetition", "--num-prompts", str(args.num_prompts)),
        *("--prefix-repetition-prefix-len", str(args.prefix_len)),
        *("--prefix-repetition-suffix-len", str(args.suffix_len)),
        *("--prefix-repetition-num-prefixes", str(args.num_prefixes)),
        *("--prefix-repetition-output-len", str(args.output_len)),
        *("--max-concurrency", str(args.max_concurrency)),
        *("--request-rate", str(args.request_rate), "--seed", str(args.seed + run)),
        *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "99"),
    ]
    if args.model is not None:
        argv += ["--tokenizer", args.model]
    if args.result_dir is not None:
        argv += ["--save-result", "--result-dir", args.result_dir]
        argv += ["--result-filename", f"routing-{policy}-run{run}.json"]
    return argv


def main() -> None:
    args = parse_args()
    policies = list(dict.fromkeys([*args.policies, "round_robin"]))  # the baseline, once
    started = time.monotonic()
    records: dict[str, list[RequestRecord]] = {p: [] for p in policies}
    seconds = dict.fromkeys(policies, 0.0)
    with ExitStack() as stack:
        fleets = {p: Fleet(fleet_spec(args, p)) for p in policies}
        for fleet in fleets.values():
            stack.enter_context(fleet)
        for run in range(args.repeats):
            shift = run % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                print(f"\n## run {run}, routing policy {policy}", flush=True)
                argv = bench_argv(args, fleets[policy].endpoint, policy, run)
                outcome = serve(build_parser().parse_args(argv))
                if outcome.metrics.failed:
                    raise SystemExit(f"{policy}: {outcome.metrics.failed} requests failed")
                records[policy] += outcome.records
                seconds[policy] += outcome.metrics.duration_s
    totals = {p: compute_metrics(records[p], seconds[p], [99.0]) for p in policies}
    print_table(args, totals, time.monotonic() - started)


def print_table(
    args: argparse.Namespace, totals: dict[str, BenchmarkMetrics], elapsed_s: float
) -> None:
    print(
        f"\n# llmfleet routing bench — {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores; per policy a fleet of 2 unified workers "
        f"({args.worker_threads} torch thread, {args.num_kv_blocks} KV blocks each), kvstore "
        f"{'on' if args.kvstore else 'off'}; {args.repeats} runs x {args.num_prompts} "
        f"prefix-repetition prompts ({args.num_prefixes} prefixes of {args.prefix_len} tokens + "
        f"{args.suffix_len}-token suffixes, {args.output_len} output tokens), max concurrency "
        f"{args.max_concurrency}, request rate {args.request_rate:g}; {elapsed_s:.0f} s in all"
    )
    names = list(totals)
    others = [p for p in names if p != "round_robin"]
    heads = " | ".join(f"{p} vs round_robin" for p in others)
    print(f"| metric | {' | '.join(names)} | {heads} |")
    print("|---" * (1 + len(names) + len(others)) + "|")
    rr = totals["round_robin"]

    def figures(m: BenchmarkMetrics) -> list[float]:
        ttft = m.distributions["ttft"]
        e2el = m.distributions["e2el"]
        return [ttft.mean, ttft.median, ttft.percentiles[99.0], e2el.mean, m.output_throughput]

    labels = ["mean TTFT (ms)", "median TTFT (ms)", "P99 TTFT (ms)", "mean E2EL (ms)"]
    labels.append("output tok/s")
    table = {p: figures(m) for p, m in totals.items()}
    base = figures(rr)
    for i, label in enumerate(labels):
        cells = [f"{table[p][i]:.1f}" for p in names]
        # times and throughput alike: above 1x, the policy does better than round robin
        better = [base[i] / table[p][i] if table[p][i] > 0 else 0.0 for p in others]
        if label == "output tok/s":
            better = [table[p][i] / base[i] if base[i] > 0 else 0.0 for p in others]
        ratios = [f"{r:.2f}x" for r in better]
        print(f"| {label} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    cached = [m.total_cached_tokens / max(m.total_input_tokens, 1) for m in totals.values()]
    shares = " | ".join(f"{c:.0%}" for c in cached)
    print(f"| prompt tokens found in a prefix cache | {shares} |{' |' * len(others)}")


if __name__ == "__main__":
    main()
