"""bf16 matrix-vector products (M = 1) of Llama-3-8B's projections: our GEMV vs cuBLAS.

    python -m llmfleet.kernels.bench_gemv [--quick] [--save]

For each projection shape (N, K) (q/k/v, o, gate/up, down, output head) every candidate block
configuration is checked against the float32 reference on fresh random data (output
allocated uninitialized, so an unwritten row shows), then timed as the median of CUDA-graph
replays with the weights rotating over enough copies to exceed L2, like `F.linear` beside it.
Bandwidth counts the weight once and is compared with the device-to-device copy rate measured
in the same run (bytes read + written, so a pure read stream can pass 100%). "ours" is what
`gemv` picks by itself (this device's tuned file, else the untuned default); `--save` writes
each shape's fastest candidate into the tuned file (kernels/configs/gemv/).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from llmfleet.kernels import gemv as gv
from llmfleet.kernels.bench_attention import copy_bandwidth
from llmfleet.kernels.bench_int4 import bench, rel_err, rotating

PROJECTIONS = {
    "q/k/v": (6144, 4096),
    "o": (4096, 4096),
    "gate/up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


def candidates(quick: bool) -> list[gv.GemvConfig]:
    shapes = [(8, 512, 4), (4, 512, 4), (16, 512, 8), (8, 1024, 8), (8, 256, 4), (4, 1024, 4)]
    if quick:
        shapes = shapes[:2]
    out = [gv.GemvConfig(bn, bk, w, 1) for bn, bk, w in shapes]
    staged = [(8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8)]
    out += [gv.GemvConfig(bn, bk, w, 3) for bn, bk, w in staged]
    return out


def time_shape(name: str, n: int, k: int, copy: float, quick: bool) -> tuple[str, gv.GemvConfig]:
    """One table row (cuBLAS, ours as picked, our best candidate for W (n, k)) and the best."""
    nbytes = n * k * 2
    weights, pick = rotating(
        lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, nbytes
    )
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cublas = bench(lambda: F.linear(x, pick()))
    picked = gv.get_config(n, k, x.dtype, x.device)
    times: dict[gv.GemvConfig, float] = {}
    for cfg in [picked, *(c for c in candidates(quick) if c != picked)]:
        for _ in range(2):  # fresh data each time
            w, xx = weights[0], torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            err = rel_err(gv.gemv(xx, w, config=cfg).float(), gv.gemv_ref(xx, w).float())
            if not err <= 4e-3:
                raise SystemExit(f"{name} {cfg}: relative error {err:.2e}")
        times[cfg] = bench(lambda cfg=cfg: gv.gemv(x, pick(), config=cfg))
    best = min(times, key=times.__getitem__)
    default = times[picked]

    def pct(us: float) -> float:
        return 100 * nbytes / us / 1e3 / copy

    row = (
        f"{name:8s} {n:6d} {k:6d} {cublas:9.1f} {pct(cublas):5.0f} {default:10.1f} "
        f"{pct(default):5.0f} {times[best]:8.1f} {pct(times[best]):5.0f} {cublas / default:6.2f}x "
        f"{best}"
    )
    return row, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two configurations only")
    ap.add_argument("--save", action="store_true", help="write the fastest into the tuned file")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s")
    print(
        f"{'proj':8s} {'N':>6s} {'K':>6s} {'cuBLAS us':>9s} {'%copy':>5s} {'ours us':>10s} "
        f"{'%copy':>5s} {'best us':>8s} {'%copy':>5s} {'cuBLAS/ours':>7s} best config"
    )
    best: dict[tuple[int, int], gv.GemvConfig] = {}
    for name, (n, k) in PROJECTIONS.items():
        row, best[n, k] = time_shape(name, n, k, copy, args.quick)
        print(row, flush=True)
        torch.cuda.empty_cache()
    if args.save:
        path = gv.save_configs(torch.cuda.get_device_name(), torch.bfloat16, best)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
