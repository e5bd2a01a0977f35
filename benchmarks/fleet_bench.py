"""Fleet vs in-process engine on this machine: TTFT and inter-token latency at low load.

    make bench      # runs benchmarks/engine_bench.py, then this
    .venv/bin/python benchmarks/fleet_bench.py [--requests 8] [--max-tokens 64]

One run measures, on the bundled SmolLM2 (float32, CPU), sequential single requests (low
load): through the in-process engine (`LLM.stream`) and through a real aggregated fleet on
loopback (kvstore, tokenizer, scheduler, one unified worker; gRPC streaming client). Tokens
are timed as they arrive; ITL = (last token time - first token time) / (tokens - 1).
Targets: fleet ITL <= 1.10x in-process, fleet TTFT <= in-process + 10 ms.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import urllib.request

import torch

from llmfleet.services.worker.engine.llm import LLM
from llmfleet.services.worker.engine.sampling_params import SamplingParams
from llmfleet.shared.client import GenerationClient
from llmfleet.shared.config import EngineConfig
from llmfleet.shared.launcher import Fleet, FleetSpec


def prompts(tokenizer, count: int, n_tokens: int) -> list[list[int]]:
    out = []
    for i in range(count):
        text = " ".join(f"Request {i} sentence {j}: a bench of llamas." for j in range(n_tokens))
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens])
    return out


def shifted(ps: list[list[int]], k: int) -> list[list[int]]:
    """The same prompts with every id moved by `k` (distinct blocks, same lengths)."""
    return [[(t + k) % 40000 for t in p] for p in ps]


def timings(token_times: list[float], start: float) -> tuple[float, float]:
    ttft = token_times[0] - start
    itl = (token_times[-1] - token_times[0]) / max(len(token_times) - 1, 1)
    return ttft, itl


def bench_in_process(llm: LLM, ps: list[list[int]], max_tokens: int) -> list[tuple[float, float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = []
    for p in ps:
        start = time.perf_counter()
        times: list[float] = []
        for delta in llm.stream(p, params):
            now = time.perf_counter()
            times.extend([now] * len(delta.token_ids))
        res.append(timings(times, start))
    return res


def bench_fleet(endpoint: str, ps: list[list[int]], max_tokens: int) -> list[tuple[float, float]]:
    res = []
    with GenerationClient(endpoint) as client:
        for p in ps:
            start = time.perf_counter()
            times: list[float] = []
            for delta in client.stream(
                token_ids=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ):
                now = time.perf_counter()
                times.extend([now] * len(delta.token_ids))
            res.append(timings(times, start))
    return res


def step_seconds(metrics_port: str) -> tuple[float, float]:
    """(sum, count) of the worker's `llmfleet:engine_step_seconds` histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    values = {"sum": 0.0, "count": 0.0}
    for line in text.decode().splitlines():
        for key in values:
            if line.startswith(f"llmfleet:engine_step_seconds_{key}{{"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def summary(rows: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8, help="per side and round")
    ap.add_argument("--rounds", type=int, default=3, help="in-process and fleet runs alternate")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker")
    args = ap.parse_args()

    llm = LLM(EngineConfig())
    ps = prompts(llm.tokenizer, args.requests + 1, args.prompt_tokens)
    bench_in_process(llm, ps[:1], 4)  # warm-up
    env = {"LLMFLEET_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {}
    ours: list[tuple[float, float]] = []
    fleet_rows: list[tuple[float, float]] = []
    step_sum = step_count = 0.0
    with Fleet(FleetSpec(port=0, workers=1, echo=False, env=env)) as fleet:
        bench_fleet(fleet.endpoint, ps[:1], 4)  # warm-up
        [worker] = fleet.workers
        metrics_port = worker.argv[worker.argv.index("--metrics-port") + 1]
        # Rounds alternate the two sides so that both see the same machine (this VM's speed
        # drifts by several ms per token over minutes). The fleet idles during in-process runs.
        for r in range(args.rounds):
            # Distinct prompts per side and round, so that no run gets prefix-cache hits.
            ours += bench_in_process(llm, shifted(ps[1:], 2 * r), args.max_tokens)
            before = step_seconds(metrics_port)
            fleet_rows += bench_fleet(fleet.endpoint, shifted(ps[1:], 2 * r + 1), args.max_tokens)
            after = step_seconds(metrics_port)
            step_sum += after[0] - before[0]
            step_count += after[1] - before[1]
            n = len(ps) - 1
            (ti, ii), (tf, itf) = summary(ours[-n:]), summary(fleet_rows[-n:])
            step = (after[0] - before[0]) / max(after[1] - before[1], 1)
            print(
                f"round {r + 1}: TTFT {ti * 1e3:.1f} / {tf * 1e3:.1f} ms, ITL {ii * 1e3:.2f} / "
                f"{itf * 1e3:.2f} ms (in-process / fleet), worker step {step * 1e3:.2f} ms",
                flush=True,
            )
    del llm
    step_ms = step_sum / max(step_count, 1) * 1e3
    ttft_in, itl_in = summary(ours)
    ttft_fl, itl_fl = summary(fleet_rows)
    print(
        f"\n# llmfleet fleet bench — {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, float32, SmolLM2-135M, "
        f"{args.rounds} alternating rounds of {args.requests} sequential requests per side, "
        f"{args.prompt_tokens}-token prompts, "
        f"{args.max_tokens} output tokens (medians)"
    )
    print("| metric | in-process engine | fleet (gRPC + ZMQ, 4 services) | fleet vs in-process |")
    print("|---|---|---|---|")
    print(
        f"| TTFT (ms) | {ttft_in * 1e3:.1f} | {ttft_fl * 1e3:.1f} | "
        f"{(ttft_fl - ttft_in) * 1e3:+.1f} ms |"
    )
    print(
        f"| inter-token latency (ms) | {itl_in * 1e3:.2f} | {itl_fl * 1e3:.2f} | "
        f"{itl_fl / itl_in:.3f}x |"
    )
    print(
        f"| worker engine step inside the fleet (ms, mean) | — | {step_ms:.2f} | "
        f"{step_ms / (itl_in * 1e3):.3f}x of in-process ITL |"
    )
    print("\ntargets: ITL <= 1.10x, TTFT <= +10 ms")


if __name__ == "__main__":
    main()
