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
import dataclasses
import os
import platform
import random
import time

from fleet_load import HEADER, Load, engine_load, row, serve_load

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.engine.engine import LLMEngine
from llmfleet.shared.core.config import EngineConfig

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


def run_engine(args: argparse.Namespace, settings: dict[str, object], num: int) -> Load:
    """`num` random prompts through one in-process engine, `max_num_seqs` at a time."""
    engine = LLMEngine.from_config(EngineConfig(**settings))  # type: ignore[arg-type]
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(num)]
    return engine_load(engine, prompts, args.output_len, int(settings["max_num_seqs"]))  # type: ignore[call-overload]


def run_fleet(args: argparse.Namespace, settings: dict[str, object], workers: int) -> Load:
    spec = FleetSpec(port=0, workers=workers, engine=settings, startup_timeout_s=300)
    workload = [
        *("--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
        *("--num-warmups", "4"),
    ]
    with Fleet(spec) as fleet:
        return serve_load(["--endpoint", fleet.endpoint], workload)


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
            print(f"engines {eng.tok_s * workers:.0f} tok/s, fleet {fleet.tok_s:.0f} tok/s")
    print(
        f"\n# fleet vs its engines, simulated workers — {time.strftime('%Y-%m-%d')}, "
        f"{platform.machine()}, {os.cpu_count()} cores; {args.num_prompts} requests of "
        f"{args.input_len} + {args.output_len} tokens at concurrency {args.concurrency}, "
        f"gRPC, kvstore on; {time.monotonic() - started:.0f} s in all"
    )
    print(HEADER)
    for workers, rate, eng, fleet in rows:
        engines = dataclasses.replace(eng, tok_s=eng.tok_s * workers)
        print(row(f"{workers} worker(s), engines set to {rate:g} tok/s", engines, fleet))
    for workers in args.workers:
        kept = [r for w, r, e, f in rows if w == workers and f.tok_s >= 0.9 * e.tok_s * w]
        best = max((f.tok_s for w, _, _, f in rows if w == workers), default=0.0)
        print(
            f"{workers} worker(s): highest fleet rate {best:.0f} tok/s; kept >= 0.9x of the "
            f"engines up to {max(kept):g} tok/s" if kept else
            f"{workers} worker(s): highest fleet rate {best:.0f} tok/s; below 0.9x at every rate"
        )  # fmt: skip


if __name__ == "__main__":
    main()
