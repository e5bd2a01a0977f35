"""Fleet vs in-process engine on this machine: TTFT and inter-token latency at low load.

    make bench      # runs benchmarks/engine_bench.py, then this
    .venv/bin/python benchmarks/fleet_bench.py [--pairs 32] [--max-tokens 64]

One run measures, on the bundled SmolLM2 (float32, CPU), sequential single requests (low
load): through the in-process engine (`LLM.stream`) and through a real aggregated fleet on
loopback (kvstore, tokenizer, router, one unified worker; gRPC streaming client), the two
alternating request by request. Tokens are timed as they arrive; ITL = (last token time - first
token time) / (tokens - 1). Reported: each side's medians, and the medians of the per-pair
differences (TTFT) and ratios (ITL), which cancel the machine's drift.
Targets: fleet ITL <= 1.10x in-process, fleet TTFT <= in-process + 10 ms.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.client.llm import LLM
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams


def prompts(tokenizer, count: int, n_tokens: int) -> list[list[int]]:
    """`count` prompts of `n_tokens` ids, each distinct from its first block on."""
    out = []
    for i in range(count):
        text = " ".join(f"Request {i} sentence {j}: a bench of llamas." for j in range(n_tokens))
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens])
    return out


def timed_stream(open_stream: Callable[[], Iterable[Any]]) -> tuple[float, float]:
    """(TTFT, ITL) of one streamed request, timed from just before `open_stream()` starts it;
    ITL = (last token time - first token time) / (tokens - 1)."""
    start = time.perf_counter()
    times: list[float] = []
    for delta in open_stream():
        now = time.perf_counter()
        times.extend([now] * len(delta.token_ids))
    itl = (times[-1] - times[0]) / max(len(times) - 1, 1)
    return times[0] - start, itl


def run_in_process(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return timed_stream(lambda: llm.stream(prompt, params))


def run_fleet(client: GenerationClient, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    return timed_stream(
        lambda: client.stream(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
    )


def step_seconds(metrics_port: str) -> tuple[float, float]:
    """(sum, count) of the worker's `llmfleet:engine_step_seconds` histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    values = {"sum": 0.0, "count": 0.0}
    for line in text.decode().splitlines():
        for key in values:
            if line.startswith(f"llmfleet:engine_step_seconds_{key}{{"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=32, help="requests per side")
    ap.add_argument("--gap-ms", type=float, default=100.0, help="idle time before each request")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker")
    args = ap.parse_args()

    llm = LLM(EngineConfig())
    # Distinct prompts for every request of both sides, so that none gets prefix-cache hits.
    ps = prompts(llm.tokenizer, 2 * args.pairs + 2, args.prompt_tokens)
    env = {"LLMFLEET_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {}
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    with (
        Fleet(FleetSpec(port=0, workers=1, echo=False, env=env)) as fleet,
        GenerationClient(fleet.endpoint) as client,
    ):
        run_in_process(llm, ps[0], 4)  # warm-up
        run_fleet(client, ps[1], 4)
        [worker] = fleet.workers
        metrics_port = worker.argv[worker.argv.index("--metrics-port") + 1]
        before = step_seconds(metrics_port)
        # The sides alternate request by request, and which goes first alternates per pair, so
        # both see the same machine: this VM's speed drifts by several ms per token over
        # minutes. The gap lets the previous request's threads settle (the other side idles).
        for i in range(args.pairs):
            a, b = ps[2 * i + 2], ps[2 * i + 3]
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                time.sleep(args.gap_ms / 1e3)
                if side == 0:
                    ours.append(run_in_process(llm, a, args.max_tokens))
                else:
                    theirs.append(run_fleet(client, b, args.max_tokens))
            if (i + 1) % 8 == 0:
                (ti, ii), (tf, itf) = ours[-1], theirs[-1]
                print(
                    f"pair {i + 1}: TTFT {ti * 1e3:.1f} / {tf * 1e3:.1f} ms, ITL {ii * 1e3:.2f} / "
                    f"{itf * 1e3:.2f} ms (in-process / fleet)",
                    flush=True,
                )
        after = step_seconds(metrics_port)
    del llm
    step_ms = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
    med = statistics.median
    ttft_in, itl_in = med(r[0] for r in ours), med(r[1] for r in ours)
    ttft_fl, itl_fl = med(r[0] for r in theirs), med(r[1] for r in theirs)
    ttft_diff = med(f[0] - o[0] for o, f in zip(ours, theirs, strict=True))
    itl_ratio = med(f[1] / o[1] for o, f in zip(ours, theirs, strict=True))
    print(
        f"\n# llmfleet fleet bench — {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, float32, SmolLM2-135M, "
        f"{args.pairs} pairs of sequential requests (in-process and fleet alternating, "
        f"{args.gap_ms:.0f} ms apart), {args.prompt_tokens}-token prompts, "
        f"{args.max_tokens} output tokens (medians)"
    )
    print("| metric | in-process engine | fleet (gRPC + ZMQ, 4 services) | fleet vs in-process |")
    print("|---|---|---|---|")
    print(
        f"| TTFT (ms) | {ttft_in * 1e3:.1f} | {ttft_fl * 1e3:.1f} | "
        f"{(ttft_fl - ttft_in) * 1e3:+.1f} ms (paired: {ttft_diff * 1e3:+.1f} ms) |"
    )
    print(
        f"| inter-token latency (ms) | {itl_in * 1e3:.2f} | {itl_fl * 1e3:.2f} | "
        f"{itl_fl / itl_in:.3f}x (paired: {itl_ratio:.3f}x) |"
    )
    print(
        f"| worker engine step inside the fleet (ms, mean) | — | {step_ms:.2f} | "
        f"{step_ms / (itl_in * 1e3):.3f}x of in-process ITL |"
    )
    print("\ntargets: ITL <= 1.10x, TTFT <= +10 ms (paired medians)")


if __name__ == "__main__":
    main()
