"""The two sides of a fleet benchmark (fleet_sim_bench.py, fleet_gpu_bench.py): the same request
set through the in-process engine and through a running fleet, measured alike.

    engine = engine_load(engine, prompts, output_len, concurrency)
    fleet = serve_load(["--endpoint", fleet.endpoint], prompts_args)     # llmfleet bench serve
    print(row("aggregated, gRPC", engine, fleet))

Both report output tokens/s, TTFT and ITL percentiles (ms) and failed requests. The engine side
keeps `concurrency` requests in flight, adding the next prompt as one finishes, as
`bench serve --max-concurrency` does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmfleet.cli.benchserve.runner import serve
from llmfleet.cli.parser import build_parser
from llmfleet.engine.engine import LLMEngine
from llmfleet.shared.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class Load:
    """What one side delivered."""

    tok_s: float
    ttft_ms: tuple[float, float]  # p50, p99
    itl_ms: tuple[float, float]
    failed: int = 0


def _percentiles(values_s: list[float]) -> tuple[float, float]:
    ordered = sorted(values_s)
    if not ordered:
        return 0.0, 0.0
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.99)]
    return pick[0] * 1e3, pick[1] * 1e3


def engine_load(
    engine: LLMEngine, prompts: Sequence[list[int]], output_len: int, concurrency: int
) -> Load:
    """`prompts` through `engine`, `concurrency` at a time, `output_len` tokens each (greedy,
    ignore_eos)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    tokens = next_id = 0
    start = time.perf_counter()
    while next_id < len(prompts) or engine.has_unfinished():
        while next_id < len(prompts) and engine.num_running + engine.num_waiting < concurrency:
            rid = f"load-{next_id}-{start}"
            engine.add_request(rid, list(prompts[next_id]), params)
            sent[rid] = time.perf_counter()
            next_id += 1
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter()
                prev = last.get(out.request_id)
                (ttft if prev is None else itl).append(now - (prev or sent[out.request_id]))
                last[out.request_id] = now
                tokens += len(out.new_token_ids)
    return Load(tokens / (time.perf_counter() - start), _percentiles(ttft), _percentiles(itl))


def serve_load(target: Sequence[str], workload: Sequence[str]) -> Load:
    """`llmfleet bench serve` with `target` (e.g. --endpoint E, or --backend openai-chat
    --base-url U) and `workload` (dataset and concurrency flags)."""
    argv = [
        *("bench", "serve", "--disable-tqdm", *target, *workload),
        *("--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,itl"),
        *("--metric-percentiles", "50,99"),
    ]
    m = serve(build_parser().parse_args(argv)).metrics
    ttft, itl = m.distributions["ttft"], m.distributions["itl"]
    return Load(
        m.output_throughput,
        (ttft.percentiles[50.0], ttft.percentiles[99.0]),
        (itl.percentiles[50.0], itl.percentiles[99.0]),
        m.failed,
    )


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process (and its threads) has used so far (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """Each process's CPU use over `seconds`, in cores: "router 0.98, worker-0 1.40, ..."."""
    return ", ".join(f"{n} {(after[n] - before.get(n, 0.0)) / seconds:.2f}" for n in sorted(after))


HEADER = (
    "| path | engine tok/s | fleet tok/s | fleet / engine | engine ITL p50/p99 ms | "
    "fleet ITL p50/p99 ms | fleet TTFT p50/p99 ms | failed |\n|---|---|---|---|---|---|---|---|"
)


def row(path: str, engine: Load, fleet: Load) -> str:
    ratio = fleet.tok_s / engine.tok_s if engine.tok_s else 0.0
    return (
        f"| {path} | {engine.tok_s:.0f} | {fleet.tok_s:.0f} | {ratio:.2f}x | "
        f"{engine.itl_ms[0]:.0f} / {engine.itl_ms[1]:.0f} | "
        f"{fleet.itl_ms[0]:.0f} / {fleet.itl_ms[1]:.0f} | "
        f"{fleet.ttft_ms[0]:.0f} / {fleet.ttft_ms[1]:.0f} | {fleet.failed} |"
    )
