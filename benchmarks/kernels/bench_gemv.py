"""bf16 linear layers of Llama-3-8B's projections at decode batch sizes: ours vs cuBLAS.

    python3 benchmarks/kernels/bench_gemv.py [--m 1 2 4 ...] [--shapes N,K ...] [--quick] [--save]
                                          [--gated]

For each projection shape (N, K) (q/k/v, o, gate/up, down, output head, or `--shapes`) and
batch M, every candidate block configuration of our kernel (the GEMV at M = 1, the skinny GEMM
above) is checked against the float32 reference on fresh random data (output allocated
uninitialized, so an unwritten row shows; the skinny GEMM also rerun for identical bits and
its split-K counters checked re-armed), then timed as the median of CUDA-graph replays with
the weights rotating over enough copies to exceed L2, like `F.linear` beside it. Bandwidth
counts the weight once and is compared with the device-to-device copy rate measured in the
same run (bytes read + written, so a pure read stream can pass 100%). "ours" is what the
model's linear layer runs by itself (this device's tuned entry, else the untuned default; at
M > 1 cuBLAS where the entry says so). `--save` writes each shape's fastest candidate into
the tuned files (kernels/configs/gemv/, kernels/configs/skinny_gemm/); at M > 1 a null entry
where cuBLAS was within 1% of it, so the layer keeps cuBLAS there.

`--gated` times the fused gate/up projection with its SwiGLU instead (the gate/up shape, or
`--shapes` as [gate | up] weights): the kernels computing the activation in their epilogue
against the projection followed by the `silu_and_mul` kernel; `--save` writes the gated
entries (kernels/configs/gemv_silu/ and skinny_gemm_silu/).

Our kernels are timed and chosen without programmatic dependent launch (PDL), like cuBLAS;
the "PDL us" column times the best candidate with it. Back to back, copies of one kernel
launched early under PDL can read slower than plain launches, while in a decode step, whose
kernels alternate with small ones, PDL saves time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from bench_attention import copy_bandwidth
from bench_int4 import bench, rel_err, rotating

from llmfleet.kernels import dispatch
from llmfleet.kernels import gemv as gv
from llmfleet.kernels import skinny_gemm as sg
from llmfleet.kernels.silu_and_mul import silu_and_mul
from llmfleet.kernels.triton_utils import even_split, programmatic_launch

PROJECTIONS = {
    "q/k/v": (6144, 4096),
    "o": (4096, 4096),
    "gate/up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


def percent_of_copy(nbytes: int, copy: float, us: float) -> float:
    """Weight bytes per `us` as a percentage of the copy rate (GB/s)."""
    return 100 * nbytes / us / 1e3 / copy


def short(cfg: gv.GemvConfig | sg.SkinnyConfig) -> str:
    """128x128 s4 w4 st4: block_n x block_k, [split,] warps, stages."""
    split = f" s{cfg.split_k}" if isinstance(cfg, sg.SkinnyConfig) else ""
    return f"{cfg.block_n}x{cfg.block_k}{split} w{cfg.num_warps} st{cfg.num_stages}"


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
    with programmatic_launch(True):
        chained = bench(lambda: gv.gemv(x, pick(), config=best))

    pct = functools.partial(percent_of_copy, nbytes, copy)

    row = (
        f"{name:8s} {n:6d} {k:6d} {cublas:9.1f} {pct(cublas):5.0f} {default:10.1f} "
        f"{pct(default):5.0f} {times[best]:8.1f} {pct(times[best]):5.0f} {chained:6.1f} "
        f"{cublas / default:6.2f}x {short(best)}"
    )
    return row, best


def skinny_candidates(n: int, k: int, quick: bool) -> list[sg.SkinnyConfig]:
    shapes = [(64, 256, 4, 3), (128, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 8), (128, 64, 4, 6)]
    shapes += [(256, 64, 8, 4)]
    if quick:
        shapes = shapes[:2]
    out = set()
    for bn, bk, warps, stages in shapes:
        for per_sm in (1, 2, 3):  # programs per SM of a 132-SM part
            split = even_split(triton.cdiv(k, bk), triton.cdiv(n, bn), per_sm)
            out.add(sg.SkinnyConfig(bn, bk, split, warps, stages))
    return sorted(out, key=lambda c: (c.block_n, c.block_k, c.split_k))


def checked_times(
    name: str,
    m: int,
    cands: list[gv.GemvConfig | sg.SkinnyConfig],
    run: Callable[[torch.Tensor, torch.Tensor, gv.GemvConfig | sg.SkinnyConfig], torch.Tensor],
    ref: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    bound: float,
    weights: list[torch.Tensor],
    pick: Callable[[], torch.Tensor],
    x: torch.Tensor,
) -> dict[gv.GemvConfig | sg.SkinnyConfig, float]:
    """Microseconds of `run(x, W, cfg)` per candidate, over rotating weights. Each candidate is
    first checked twice on fresh data: relative error against `ref` within `bound`, a rerun
    bit-identical, split-K counters re-armed (else the program stops). Candidates too large
    for shared memory are left out."""
    k = x.shape[1]
    times: dict[gv.GemvConfig | sg.SkinnyConfig, float] = {}
    for cfg in dict.fromkeys(cands):
        for _ in range(2):  # fresh data each time
            w, xx = weights[0], torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            try:
                out = run(xx, w, cfg)
            except triton.runtime.errors.OutOfResources:
                break
            err = rel_err(out.float(), ref(xx, w).float())
            if not err <= bound or not torch.equal(out, run(xx, w, cfg)):
                raise SystemExit(f"{name} M={m} {cfg}: relative error {err:.2e} or reruns differ")
            if any(c.any().item() for _, c in sg._WORKSPACE._by_device.values()):
                raise SystemExit(f"{name} M={m} {cfg}: split-K counters not re-armed")
        else:
            times[cfg] = bench(lambda cfg=cfg: run(x, pick(), cfg))
    return times


def time_skinny(
    name: str, n: int, k: int, m: int, copy: float, quick: bool
) -> tuple[str, sg.SkinnyConfig | None]:
    """One table row at M > 1 (cuBLAS, ours as picked, our best candidate) and the entry to
    save: the best candidate, or None where cuBLAS was within 1% of it."""
    nbytes = n * k * 2
    weights, pick = rotating(
        lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, nbytes
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cublas = bench(lambda: F.linear(x, pick()))
    times = checked_times(
        name, m, skinny_candidates(n, k, quick),
        lambda xx, w, cfg: sg.skinny_gemm(xx, w, config=cfg),
        lambda xx, w: xx.float() @ w.float().t(), 4e-3, weights, pick, x,
    )  # fmt: skip
    best = min(times, key=times.__getitem__)
    with programmatic_launch(True):
        chained = bench(lambda: sg.skinny_gemm(x, pick(), config=best))
    picked = sg.choose(m, n, k, x.dtype, x.device)
    if picked is None:
        ours, how = cublas, "cuBLAS"
    else:
        ours = times.get(picked) or bench(lambda: sg.skinny_gemm(x, pick(), config=picked))
        how = "skinny"
    entry = best if times[best] < 0.99 * cublas else None

    pct = functools.partial(percent_of_copy, nbytes, copy)

    row = (
        f"{name:8s} {m:3d} {n:6d} {k:6d} {cublas:9.1f} {pct(cublas):5.0f} {ours:8.1f} {how:6s} "
        f"{pct(ours):5.0f} {times[best]:8.1f} {pct(times[best]):5.0f} {chained:6.1f} "
        f"{cublas / times[best]:6.2f}x {short(entry) if entry else 'cuBLAS'}"
    )
    return row, entry


def time_gated(
    name: str, n: int, k: int, m: int, copy: float, quick: bool
) -> tuple[str, gv.GemvConfig | sg.SkinnyConfig | None]:
    """One row of the fused gate/up projection W (n, k) with its SwiGLU at M rows: cuBLAS then
    `silu_and_mul`; our unfused path (the layer's projection, then `silu_and_mul`); the gated
    kernel as the layer picks it; our best gated candidate (the GEMV at M = 1, the skinny GEMM
    above; candidates too large for shared memory are skipped). The entry to save: the best
    candidate, or None where the unfused path was within 1% of it."""
    nbytes = n * k * 2
    weights, pick = rotating(
        lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, nbytes
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cublas = bench(lambda: silu_and_mul(F.linear(x, pick())))
    unfused = bench(lambda: silu_and_mul(dispatch.decode_linear(x, pick())))
    picked = bench(lambda: dispatch.decode_gated_linear(x, pick()))
    cands: list[gv.GemvConfig | sg.SkinnyConfig]
    if m == 1:  # rows per half: the plain GEMV's candidates and their halves
        plain = candidates(quick)
        cands = [gv.get_config(n, k, x.dtype, x.device, gated=True), *plain]
        cands += [dataclasses.replace(c, block_n=max(1, c.block_n // 2)) for c in plain]
    else:
        cands = list(skinny_candidates(n // 2, k, quick))
    kernel = gv.gemv if m == 1 else sg.skinny_gemm
    times = checked_times(
        name, m, cands, lambda xx, w, cfg: kernel(xx, w, config=cfg, gated=True),
        lambda xx, w: gv.swiglu_tail((xx.float() @ w.float().t()).to(xx.dtype), True),
        8e-3, weights, pick, x,
    )  # fmt: skip
    best = min(times, key=times.__getitem__)
    run = functools.partial(kernel, config=best, gated=True)
    with programmatic_launch(True):
        chained = bench(lambda: run(x, pick()))
    entry = best if times[best] < 0.99 * unfused else None
    pct = functools.partial(percent_of_copy, nbytes, copy)
    row = (
        f"{name:8s} {m:3d} {n:6d} {k:6d} {cublas:9.1f} {unfused:8.1f} {picked:8.1f} "
        f"{times[best]:8.1f} {pct(times[best]):5.0f} {chained:6.1f} "
        f"{unfused / times[best]:6.2f}x {short(best)}{'' if entry else ' (unfused)'}"
    )
    return row, entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--shapes", nargs="+", help="N,K pairs instead of Llama-3-8B's projections")
    ap.add_argument("--quick", action="store_true", help="two configurations only")
    ap.add_argument("--save", action="store_true", help="write the fastest into the tuned files")
    ap.add_argument(
        "--gated",
        action="store_true",
        help="the fused gate/up projection with its SwiGLU (gated kernels) instead",
    )
    args = ap.parse_args()
    if any(not 1 <= m <= sg.MAX_M for m in args.m):
        ap.error(f"--m values must be in 1..{sg.MAX_M}")
    shapes = {"gate/up": PROJECTIONS["gate/up"]} if args.gated else PROJECTIONS
    if args.shapes:
        shapes = {s: (int(s.split(",")[0]), int(s.split(",")[1])) for s in args.shapes}
    with programmatic_launch(False):
        run(args, shapes)


def run(args: argparse.Namespace, shapes: dict[str, tuple[int, int]]) -> None:
    torch.manual_seed(0)
    if args.gated:
        run_gated(args, shapes)
        return
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s")
    best: dict[tuple[int, int], gv.GemvConfig] = {}
    if 1 in args.m:
        print(
            f"{'proj':8s} {'N':>6s} {'K':>6s} {'cuBLAS us':>9s} {'%copy':>5s} {'ours us':>10s} "
            f"{'%copy':>5s} {'best us':>8s} {'%copy':>5s} {'PDL us':>6s} {'cuBLAS/ours':>7s} "
            "best config"
        )
        for name, (n, k) in shapes.items():
            row, best[n, k] = time_shape(name, n, k, copy, args.quick)
            print(row, flush=True)
            torch.cuda.empty_cache()
    entries: dict[tuple[int, int, int], sg.SkinnyConfig | None] = {}
    if any(m > 1 for m in args.m):
        print(
            f"{'proj':8s} {'M':>3s} {'N':>6s} {'K':>6s} {'cuBLAS us':>9s} {'%copy':>5s} "
            f"{'ours us':>8s} {'runs':6s} {'%copy':>5s} {'best us':>8s} {'%copy':>5s} "
            f"{'PDL us':>6s} {'cuBLAS/best':>7s} entry"
        )
        for name, (n, k) in shapes.items():
            for m in (m for m in args.m if m > 1):
                row, entries[n, k, sg.m_bucket(m)] = time_skinny(name, n, k, m, copy, args.quick)
                print(row, flush=True)
            torch.cuda.empty_cache()
    if args.save:
        device = torch.cuda.get_device_name()
        if best:
            print(f"wrote {gv.TUNED.save(device, torch.bfloat16, best)}")
        if entries:
            print(f"wrote {sg.TUNED.save(device, torch.bfloat16, entries)}")


def run_gated(args: argparse.Namespace, shapes: dict[str, tuple[int, int]]) -> None:
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s")
    print(
        f"{'proj':8s} {'M':>3s} {'N':>6s} {'K':>6s} {'cuBLAS+act':>9s} {'unfused':>8s} "
        f"{'picked':>8s} {'best us':>8s} {'%copy':>5s} {'PDL us':>6s} {'unfused/best':>7s} "
        "best config"
    )
    gemv_entries: dict[tuple[int, int], gv.GemvConfig | None] = {}
    entries: dict[tuple[int, int, int], sg.SkinnyConfig | None] = {}
    for name, (n, k) in shapes.items():
        for m in args.m:
            row, entry = time_gated(name, n, k, m, copy, args.quick)
            if m == 1:
                gemv_entries[n, k] = entry  # type: ignore[assignment]
            else:
                entries[n, k, sg.m_bucket(m)] = entry  # type: ignore[assignment]
            print(row, flush=True)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    if args.save and gemv_entries:
        print(f"wrote {gv.TUNED_SILU.save(device, torch.bfloat16, gemv_entries)}")
    if args.save and entries:
        print(f"wrote {sg.TUNED_SILU.save(device, torch.bfloat16, entries)}")


if __name__ == "__main__":
    main()
