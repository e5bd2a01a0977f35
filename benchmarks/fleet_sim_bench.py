"""The fleet against its own engines on a CPU, with simulated workers: how much of the engines'
token rate reaches the clients.

    python benchmarks/fleet_sim_bench.py [--workers 1 8] [--rates 5000 10000] [--quick]

Workers run `--simulate` (models/simulated.py): the real engine, a step-time model for the
forward pass. For each fleet size W and engine rate R (output tokens/s of the W engines together
at full batch), the step-time model is set so that one engine with its share c = concurrency / W
of the requests decodes at R / W tokens/s:

    step = c / (R / W)  seconds,   sim_decode_ms_per_seq = (step - sim_step_ms) / c

Then, side by side in one run:
  1. the in-process engine (`LLMEngine`, no fleet): num_prompts / W requests kept c at a time,
     its output tokens/s times W, TTFT and ITL percentiles;
  2. a real fleet on loopback (`Fleet`: kvstore, tokenizer, router, W simulated workers),
     `llmfleet bench serve` over gRPC, num_prompts requests at `concurrency`.
It prints one row per (W, R): both rates, their ratio, latencies and failed requests, and the
highest engine rate at which the fleet kept >= 0.9x of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from llmfleet.cli.benchserve.runner import serve
from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.parser import build_parser
from llmfleet.engine.engine import LLMEngine
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

KV_CACHE_BYTES = 1 << 36  # simulated: the blocks of an accelerator, not host memory


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rates", type=float, nargs="+", default=[2500, 5000, 10000])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--sim-step-ms", type=float, default=10.0)
    ap.add_argument("--sim-prefill-ms-per-token", type=float, default=0.01)
    ap.add_argument("--quick", action="store_true", help="64 prompts of 128 + 64 tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.concurrency, args.input_len, args.output_len = 64, 64, 128, 64
    return args


def engine_settings(args: argparse.Namespace, workers: int, rate: float) -> dict[str, object]:
    per_engine = args.concurrency // workers
    step_ms = 1e3 * per_engine / (rate / workers)
    if step_ms <= args.sim_step_ms:
        raise SystemExit(f"rate {rate:g} needs steps shorter than --sim-step-ms")
    return {
        "simulate": True,
        "sim_step_ms": args.sim_step_ms,
        "sim_decode_ms_per_seq": (step_ms - args.sim_step_ms) / per_engine,
        "sim_prefill_ms_per_token": args.sim_prefill_ms_per_token,
        "max_num_seqs": per_engine,
        "max_num_batched_tokens": max(2048, args.input_len * 8),
        "kv_cache_bytes": KV_CACHE_BYTES,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def run_engine(args: argparse.Namespace, settings: dict[str, object], num: int) -> dict:
    """`num` requests through one in-process engine, `max_num_seqs` at a time."""
    engine = LLMEngine.from_config(EngineConfig(**settings))  # type: ignore[arg-type]
    limit = int(settings["max_num_seqs"])  # type: ignore[call-overload]
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    tokens = next_id = 0
    start = time.perf_counter()
    while next_id < num or engine.has_unfinished():
        while next_id < num and engine.num_running + engine.num_waiting < limit:
            rid = f"r{next_id}"
            prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
            engine.add_request(rid, prompt, params)
            sent[rid] = time.perf_counter()
            next_id += 1
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.new_token_ids)
            if n:
                prev = last.get(out.request_id)
                (ttft if prev is None else itl).append(now - (prev or sent[out.request_id]))
                last[out.request_id] = now
                tokens += n
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "ttft": ttft, "itl": itl}


def run_fleet(args: argparse.Namespace, settings: dict[str, object], workers: int) -> dict:
    spec = FleetSpec(port=0, workers=workers, engine=settings, startup_timeout_s=300)
    with Fleet(spec) as fleet:
        argv = [
            *("bench", "serve", "--endpoint", fleet.endpoint, "--disable-tqdm"),
            *("--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)),
            *("--random-input-len", str(args.input_len)),
            *("--random-output-len", str(args.output_len)),
            *("--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,itl"),
            *("--metric-percentiles", "50,99", "--num-warmups", "4"),
        ]
        outcome = serve(build_parser().parse_args(argv))
    m = outcome.metrics
    return {
        "tok_s": m.output_throughput,
        "failed": m.failed,
        "ttft": (
            m.distributions["ttft"].percentiles[50.0],
            m.distributions["ttft"].percentiles[99.0],
        ),
        "itl": (m.distributions["itl"].percentiles[50.0], m.distributions["itl"].percentiles[99.0]),
    }


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    rows = []
    for workers in args.workers:
        for rate in args.rates:
            settings = engine_settings(args, workers, rate)
            print(f"\n## {workers} worker(s), engine rate {rate:g} tok/s: {settings}", flush=True)
            eng = run_engine(args, settings, max(1, args.num_prompts // workers))
            fleet = run_fleet(args, settings, workers)
            rows.append((workers, rate, eng, fleet))
            print(f"engine {eng['tok_s'] * workers:.0f} tok/s, fleet {fleet['tok_s']:.0f} tok/s")
    print(
        f"\n# fleet vs its engines, simulated workers — {time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()}, {os.cpu_count()} cores; {args.num_prompts} requests of "
        f"{args.input_len} + {args.output_len} tokens at concurrency {args.concurrency}, "
        f"gRPC, kvstore on; {time.monotonic() - started:.0f} s in all"
    )
    print(
        "| workers | engine rate set | engines tok/s | fleet tok/s | fleet / engines | "
        "engine ITL p50/p99 ms | fleet ITL p50/p99 ms | fleet TTFT p50/p99 ms | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for workers, rate, eng, fleet in rows:
        engines = eng["tok_s"] * workers
        e_itl = (
            f"{1e3 * statistics.median(eng['itl']):.0f} / {1e3 * percentile(eng['itl'], 99):.0f}"
        )
        f_itl = "{:.0f} / {:.0f}".format(*fleet["itl"])
        f_ttft = "{:.0f} / {:.0f}".format(*fleet["ttft"])
        print(
            f"| {workers} | {rate:g} | {engines:.0f} | {fleet['tok_s']:.0f} | "
            f"{fleet['tok_s'] / engines:.2f}x | {e_itl} | {f_itl} | {f_ttft} | {fleet['failed']} |"
        )
    for workers in args.workers:
        kept = [r for w, r, e, f in rows if w == workers and f["tok_s"] >= 0.9 * e["tok_s"] * w]
        best = max((f["tok_s"] for w, _, _, f in rows if w == workers), default=0.0)
        print(
            f"{workers} worker(s): highest fleet rate {best:.0f} tok/s; kept >= 0.9x of the "
            f"engines up to {max(kept):g} tok/s" if kept else
            f"{workers} worker(s): highest fleet rate {best:.0f} tok/s; below 0.9x at every rate"
        )  # fmt: skip


if __name__ == "__main__":
    main()
