"""Where a decode step of the Llama-3-8B-shaped model goes, on one GPU.

    python3 benchmarks/gpu_decode_profile.py [--gemm] [--min-partition N] [--top N] [--no-pdl]

For batch 1 (context ~160) and batch 64 (context ~1024), with the model and engine of
e2e_llama3_bench.py (CUDA graphs up to batch 64), it prints:
  - the inter-token latency and the roofline (as e2e_llama3_bench.py);
  - host medians of the step's phases (schedule, the runner's host part, the chained step's,
    staging the graph's buffers, the replay call, sampling, reading tokens back including the
    wait for the device), with async scheduling on;
  - the GPU time of one graph replay (CUDA events around back-to-back replays), so wall - GPU
    is the host time the device sits idle;
  - the kernels of one replay (torch.profiler): time and launches per replay, top 14
    (`--top`). Under programmatic dependent launch a kernel starts before its predecessor
    ends and its time includes that wait; `--no-pdl` launches plainly, for clean attribution.
`--gemm` adds cuBLAS bf16 matmul timings of the model's projection shapes at M = 1, 16, 64
(achieved bandwidth against the copy bandwidth).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from decode_timing import copy_bandwidth, engine_decode_ms, random_prompts, weight_bytes_per_step
from e2e_llama3_bench import FULL, build_engine
from torch.profiler import ProfilerActivity, profile

import llmfleet.kernels.paged_attention_decode as decode_attention
from llmfleet.kernels.triton_utils import programmatic_launch
from llmfleet.shared.core.sampling_params import SamplingParams

# (N, K) of the projections: qkv, o, gate_up, down, output head
PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def gpu_ms(fn, reps: int = 50) -> float:
    """Mean GPU time of `fn` over back-to-back calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemm_table(bw: float) -> None:
    print("GEMM  M      N      K      us   GB/s  % of copy bw")
    for m in (1, 16, 64):
        for n, k in PROJECTIONS:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = gpu_ms(functools.partial(F.linear, x, w))
            nbytes = (n * k + m * k + m * n) * 2
            print(
                f"     {m:3d} {n:6d} {k:6d} {ms * 1e3:7.1f} {nbytes / ms / 1e6:6.0f} "
                f"{nbytes / ms / 1e6 / (bw / 1e9) * 100:5.0f}"
            )
            del w
        torch.cuda.empty_cache()


def time_phases(engine) -> dict[str, list[float]]:
    """Wrap the step's phases with wall-clock timers; returns the (live) samples."""
    samples: dict[str, list[float]] = {}

    def wrap(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            samples.setdefault(key, []).append(time.perf_counter() - start)
            return result

        setattr(obj, name, timed)

    graphs = engine.runner.decode_graphs
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.runner, "execute", "runner (host)")
    wrap(engine.runner, "execute_chained", "chained runner (host)")
    wrap(graphs, "_stage", "stage buffers")
    wrap(graphs, "_launch", "replay call")
    wrap(engine.sampler, "sample_ids", "sample (host)")
    wrap(engine, "_read_back", "read back (+wait)")
    return samples


def settle_decoding(engine, prompts: list[list[int]], steps: int, tag: str) -> None:
    """Add the prompts and step until every sequence decodes, then one decode step more, so
    the graph's static buffers hold a real batch at its real lengths."""
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while True:
        engine.step()
        running = engine.scheduler.running
        if len(running) == len(prompts) and all(r.num_output_tokens >= 2 for r in running):
            break
    engine.step()


def kernel_table(graph: torch.cuda.CUDAGraph, reps: int = 5) -> list[tuple[str, int, float]]:
    """(kernel name, launches per replay, us per replay) of `reps` replays, by time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        entry = agg.setdefault(ev.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += ev.device_time_total
    rows = [(name, round(n / reps), us / reps) for name, (n, us) in agg.items()]
    return sorted(rows, key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm", action="store_true", help="also time the projection GEMMs")
    ap.add_argument("--min-partition", type=int, help="decode attention's min_partition")
    ap.add_argument("--top", type=int, default=14, help="kernels listed per batch size")
    ap.add_argument("--no-pdl", action="store_true", help="launch without PDL")
    args = ap.parse_args()
    with programmatic_launch(not args.no_pdl):
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.min_partition is not None:
        default = decode_attention.default_decode_config()
        tuned = replace(default, min_partition=args.min_partition)
        decode_attention.default_decode_config = lambda: tuned

    bw = copy_bandwidth("cuda", 4 << 30)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e9:.0f} GB/s")
    if args.gemm:
        gemm_table(bw)
    plan = replace(FULL, max_num_seqs=64, graph_max_batch=64)
    engine, _ = build_engine(plan)
    weights = weight_bytes_per_step(engine.model)
    kv_per_token = engine.model_shape.kv_bytes_per_token
    samples = time_phases(engine)
    for batch, prompt, steps in ((1, 128, 64), (64, 1008, 32)):
        prompts = random_prompts(batch, prompt, plan.config.vocab_size, batch)
        engine_decode_ms(engine, [p[:32] for p in prompts], 4)  # warm-up
        samples.clear()
        wall = engine_decode_ms(engine, prompts, steps)
        ctx = prompt + steps / 2
        roof = 1e3 * (weights + batch * ctx * kv_per_token) / bw
        phases = {k: 1e3 * statistics.median(v[-steps // 2 :]) for k, v in samples.items()}
        print(f"\nbatch {batch}, context ~{ctx:.0f}: step {wall:.2f} ms, roofline {roof:.2f} ms")
        print("  host medians, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        settle_decoding(engine, prompts, steps, f"profile-{batch}")
        graph = engine.runner.decode_graphs.graphs[batch]
        gpu = gpu_ms(graph.replay, reps=20)
        print(
            f"  GPU per replay {gpu:.3f} ms ({gpu / roof:.2f}x roofline); "
            f"host time the GPU idles {wall - gpu:.2f} ms"
        )
        kernels = kernel_table(graph)
        total = sum(us for _, _, us in kernels)
        print(f"  kernels per replay: {sum(n for _, n, _ in kernels)}, {total / 1e3:.3f} ms")
        for name, n, us in kernels[: args.top]:
            print(f"  {us:9.1f} us  x{n:4d}  {name}")
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
