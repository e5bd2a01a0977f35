"""Tune fused MoE block configurations on this GPU and write them as JSON.

    python3 benchmarks/kernels/tune_fused_moe.py --model mixtral --dtype bf16

For each token count M, every config of the search grid is timed on the whole `fused_moe` (both
GEMMs, routing alignment included, CUDA-graph replays, median), on fresh random data; the
fastest is kept. The file lands in configs/fused_moe/ (or --out) under the name that
`fused_moe.load_configs` looks up for this device. The M values tuned now are merged into the
entries a file of that name already holds (`--replace` writes only the new ones), so a few
sizes can be added to a tuned table without searching the others again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton

from llmfleet.kernels import fused_moe as fm
from llmfleet.kernels.moe_routing import topk_routing

MODELS = {"mixtral": (8, 2, 4096, 14336), "qwen3_30b_a3b": (128, 8, 2048, 768)}


def search_space(m: int, top_k: int, num_experts: int) -> list[dict[str, int]]:
    rows = m * top_k / num_experts
    # 128-row tiles above 64 rows per expert, where they beat the best 64-row tile
    block_ms = (
        [16, 32] if rows <= 16 else [16, 32, 64] if rows <= 64 else [32, 64, 128] if rows <= 128
        else [64, 128]
    )  # fmt: skip
    block_ns = [64, 128] if rows <= 128 else [64, 128, 256]  # wide tiles where compute-bound
    configs = []
    for bm, bn, bk, warps, stages in itertools.product(
        block_ms, block_ns, [64, 128], [4, 8], [3, 4]
    ):
        if bm * bn >= 128 * 128 and warps == 4 or bm * bn <= 32 * 64 and warps == 8:
            continue
        configs.append(
            dict(
                BLOCK_SIZE_M=bm,
                BLOCK_SIZE_N=bn,
                BLOCK_SIZE_K=bk,
                # Above 32 rows per expert, grouped M tiles share an expert's weight tiles
                # through L2.
                GROUP_SIZE_M=1 if rows <= 32 else 8,
                num_warps=warps,
                num_stages=stages,
            )
        )
    return configs


def make_inputs(model: str, m: int, dtype: str, seed: int = 0) -> dict[str, torch.Tensor | None]:
    e, k, h, inter = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(e, 2 * inter, h, device="cuda", generator=g, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=g, dtype=torch.bfloat16) * inter**-0.5
    s1 = s2 = None
    if dtype == "fp8_w8a8":
        s1 = (w1.abs().amax(dim=2).float() / 448.0).contiguous()
        s2 = (w2.abs().amax(dim=2).float() / 448.0).contiguous()
        w1 = (w1.float() / s1[:, :, None]).to(fm.FP8_DTYPE)
        w2 = (w2.float() / s2[:, :, None]).to(fm.FP8_DTYPE)
    x = torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16)
    tw, ids = topk_routing(torch.randn(m, e, device="cuda", generator=g), k)
    return dict(x=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids, w1_scale=s1, w2_scale=s2)


def time_config(inputs: dict, cfg: dict[str, int]) -> float:
    """Median milliseconds of one fused_moe call, from CUDA-graph replays."""
    fn = lambda: fm.fused_moe(**inputs, config=cfg)  # noqa: E731
    fn()
    # do_bench_cudagraph runs fn on a stream of its own first, unordered with the default
    # stream that made the inputs: unsynchronized, a new M's first call could read routing
    # ids still being written (an illegal address)
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def tune(model: str, dtype: str, ms: list[int], budget_s: float) -> dict[str, dict[str, int]]:
    e, k, _, _ = MODELS[model]
    best: dict[str, dict[str, int]] = {}
    for m in ms:
        deadline = time.monotonic() + budget_s / len(ms)
        inputs = make_inputs(model, m, dtype, seed=m)
        default = fm.default_config(m, e, k)
        results = [(time_config(inputs, default), default)]
        for cfg in search_space(m, k, e):
            if time.monotonic() > deadline:
                break
            try:
                results.append((time_config(inputs, cfg), cfg))
            except triton.runtime.errors.OutOfResources:
                continue
        t, cfg = min(results, key=lambda r: r[0])
        print(f"{model} {dtype} M={m}: best {t * 1e3:.1f} us (default {results[0][0] * 1e3:.1f})"
              f" of {len(results)}: {cfg}", flush=True)  # fmt: skip
        best[str(m)] = cfg
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--dtype", choices=["bf16", "fp8_w8a8"], default="bf16")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument(
        "--budget-s", type=float, default=600.0, help="search time, split over the M values"
    )
    p.add_argument("--out", type=Path, default=fm.CONFIG_DIR)
    p.add_argument(
        "--replace", action="store_true", help="drop the existing file's entries for other M"
    )
    args = p.parse_args()
    e, _, _, inter = MODELS[args.model]
    best = tune(args.model, args.dtype, args.m, args.budget_s)
    name = fm.config_file_name(e, inter, torch.cuda.get_device_name(), args.dtype)
    path = args.out / name
    if path.is_file() and not args.replace:
        best = fm.merge_config_tables(json.loads(path.read_text()), best)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(best, indent=2) + "\n")
    print(json.dumps(best))
    print(f"wrote {path} (M = {', '.join(best)})")


if __name__ == "__main__":
    main()
