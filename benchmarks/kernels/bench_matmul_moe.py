"""Benchmark: FP8 W8A8 GEMM, INT4 weight-only GEMM and fused MoE against the best PyTorch path.

    python3 benchmarks/kernels/bench_matmul_moe.py [--quick]

Ceilings first (device-to-device copy bandwidth, bytes read + written; torch bf16 matmul
TFLOP/s), then one table. Every timing is the median of CUDA-graph replays (launch gaps hidden
for both sides) on random data; `best` is the fastest of a few candidate block configs, `dflt`
the launcher's own choice. `roof` is the fraction of the copy bandwidth (memory-bound rows) or
of the bf16 matmul rate (x2 for FP8; compute-bound rows) that the default achieved.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from llmfleet.kernels import fused_moe as fm
from llmfleet.kernels import int4_gemv as gv
from llmfleet.kernels import int4_matmul as i4
from llmfleet.kernels import int4_pack as ip
from llmfleet.kernels import scaled_mm as smm
from llmfleet.kernels.moe_routing import topk_routing
from llmfleet.kernels.quant import per_token_quant

FP8 = torch.float8_e4m3fn
MOE_MODELS = {"mixtral": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def bench(fn) -> float:
    """Median microseconds per call."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def ceilings() -> tuple[float, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    triton.testing.do_bench(lambda: a @ b, warmup=500, rep=500)  # clocks up from idle first
    mm_us = bench(lambda: a @ b)
    n = 1 << 31
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src))
    return 2 * n / (copy_us * 1e-6), 2 * 8192**3 / (mm_us * 1e-6)  # bytes/s read+written


def row(name: str, ours: float, best: float, base: float, roof: float, note: str = "") -> str:
    return (
        f"{name:<38} {ours:>9.1f} {best:>9.1f} {base:>9.1f} {base / ours:>6.2f}x"
        f" {base / best:>6.2f}x {roof:>5.0%}  {note}"
    )


def bench_torch_scaled_mm(a_q, b_q, a_s, b_s) -> float:
    bt, bs = b_q.t(), b_s.t().contiguous()  # (K, N) column-major, (1, N)
    m = a_q.shape[0]
    if m % 16:  # cuBLASLt FP8 wants M % 16 == 0 on some versions: time the padded product
        try:
            torch._scaled_mm(a_q, bt, scale_a=a_s, scale_b=bs, out_dtype=torch.bfloat16)
        except RuntimeError:
            pad = 16 - m % 16
            a_q = torch.cat([a_q, a_q.new_zeros(pad, a_q.shape[1])])
            a_s = torch.cat([a_s, a_s.new_ones(pad, 1)])
    return bench(
        lambda: torch._scaled_mm(a_q, bt, scale_a=a_s, scale_b=bs, out_dtype=torch.bfloat16)
    )


def bench_scaled_mm(bw: float, flops: float, ms: list[int], shapes) -> list[str]:
    out = []
    for n, k in shapes:
        b = torch.randn(n, k, device="cuda")
        b_q, b_s = per_token_quant(b, FP8)  # per-channel weight scales (N, 1)
        for m in ms:
            a_q, a_s = per_token_quant(torch.randn(m, k, device="cuda"), FP8)
            ours = bench(lambda: smm.scaled_mm(a_q, b_q, a_s, b_s))  # noqa: B023
            cands = [
                smm.MatmulConfig(bm, bn, bk, s, 8, w, st)
                for bm, bn, bk, s, w, st in (
                    [(16, 64, 256, s, 4, 4) for s in (1, 2, 4)]
                    + [(16, 32, 256, 1, 4, 5), (16, 128, 128, 2, 4, 4), (16, 128, 128, 1, 4, 4)]
                    if m <= 16
                    else [
                        (64, 64, 256, 2, 4, 4),
                        (64, 64, 256, 1, 4, 4),
                        (64, 128, 128, 1, 4, 4),
                        (64, 128, 256, 1, 8, 3),
                        (32, 64, 256, 1, 4, 4),
                        (64, 32, 256, 1, 4, 5),
                    ]
                    if m <= 64
                    else [
                        (128, 256, 128, 1, 8, 3),
                        (128, 256, 128, 1, 8, 4),
                        (128, 128, 128, 1, 8, 4),
                        (128, 256, 64, 1, 8, 4),
                        (256, 128, 128, 1, 8, 3),
                    ]
                )
            ]
            best, best_cfg = ours, "default"
            for cfg in cands:
                try:
                    t = bench(lambda: smm.scaled_mm(a_q, b_q, a_s, b_s, config=cfg))  # noqa: B023
                except Exception as exc:  # a candidate may exceed shared memory
                    print(f"  skip {cfg}: {type(exc).__name__}")
                    continue
                if t < best:
                    best, best_cfg = t, cfg
            base = bench_torch_scaled_mm(a_q, b_q, a_s, b_s)
            if m <= 64:
                roof = (n * k + m * k + 2 * m * n) / (ours * 1e-6) / bw
            else:
                roof = 2 * m * n * k / (ours * 1e-6) / (2 * flops)
            name = f"fp8 W8A8 M={m} N={n} K={k}"
            out.append(row(name, ours, best, base, roof, f"best={best_cfg}"))
            print(out[-1], flush=True)
    return out


def bench_int4(bw: float, ms: list[int], shapes, group: int = 128) -> list[str]:
    """INT4 weight-only GEMM vs the bf16 matmul, both reading weights rotated past L2 (the
    31 MB INT4 weight of a 4096 x 14336 layer would otherwise stay in L2 between replays)."""
    from bench_int4 import gemv_candidates, rotating

    out = []
    for n, k in shapes:
        wbytes = k * n // 2 + 2 * (k // group) * n * 2
        _, pick = rotating(lambda: ip.random_int4(k, n, group, torch.bfloat16), wbytes)  # noqa: B023
        dense = itertools.cycle(
            [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        )
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = bench(lambda: i4.int4_matmul(x, *pick(), group))  # noqa: B023
            best, best_cfg = ours, "default"
            for cfg in gemv_candidates(m, n, k, group) if m <= 16 else []:
                t = bench(lambda: gv.int4_gemv(x, *pick(), group, cfg))  # noqa: B023
                if t < best:
                    best, best_cfg = t, cfg
            base = bench(lambda: x @ next(dense).t())  # noqa: B023
            nbytes = wbytes + m * (k + n) * 2
            roof = nbytes / (ours * 1e-6) / bw
            out.append(
                row(f"int4 g{group} M={m} N={n} K={k}", ours, best, base, roof, f"best={best_cfg}")
            )
            print(out[-1], flush=True)
    return out


def expert_loop(x, w1, w2, tw, ids):
    """The plain PyTorch baseline: one gather + two matmuls per expert."""
    inter = w1.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].t()
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (h @ w2[e].t()) * tw[tok, j, None].to(x.dtype))
    return out


def bench_moe(bw: float, flops: float, ms: list[int], fp8: bool) -> list[str]:
    out = []
    for model, (e, k, h, inter) in MOE_MODELS.items():
        w1 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
        w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
        s1 = s2 = None
        if fp8:
            s1 = (w1.abs().amax(dim=2).float() / 448.0).contiguous()
            s2 = (w2.abs().amax(dim=2).float() / 448.0).contiguous()
            w1q = (w1.float() / s1[:, :, None]).to(FP8)
            w2q = (w2.float() / s2[:, :, None]).to(FP8)
        for m in ms:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            tw, ids = topk_routing(torch.randn(m, e, device="cuda"), k)
            if fp8:
                ours = bench(lambda: fm.fused_moe(x, w1q, w2q, tw, ids, s1, s2))  # noqa: B023
            else:
                ours = bench(lambda: fm.fused_moe(x, w1, w2, tw, ids))  # noqa: B023
            expert_loop(x, w1, w2, tw, ids)
            torch.cuda.synchronize()
            # The loop syncs on nonzero(): no graph; event timing, median of repeats.
            base = (
                triton.testing.do_bench(
                    lambda: expert_loop(x, w1, w2, tw, ids),  # noqa: B023
                    warmup=20,
                    rep=200 if m < 4096 else 500,
                    return_mode="median",
                )
                * 1e3
            )
            touched = int(torch.unique(ids).numel())
            elem = 1 if fp8 else 2
            wbytes = touched * 3 * h * inter * elem
            if m <= 64:
                roof = wbytes / (ours * 1e-6) / bw
            else:
                roof = 2 * m * k * 3 * h * inter / (ours * 1e-6) / (flops * (2 if fp8 else 1))
            tag = "fp8" if fp8 else "bf16"
            out.append(row(f"moe {tag} {model} M={m} ({touched} exp)", ours, ours, base, roof))
            print(out[-1], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--only", choices=["fp8", "int4", "moe"], nargs="*")
    args = p.parse_args()
    torch.manual_seed(0)
    bw, flops = ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    only = set(args.only or ["fp8", "int4", "moe"])
    sizes = [4096, 14336]
    shapes = [(sizes[0], sizes[0])] if args.quick else [(n, k) for n in sizes for k in sizes]
    lines = []
    if "fp8" in only:
        lines += bench_scaled_mm(bw, flops, [1, 16, 64, 4096], shapes)
    if "int4" in only:
        lines += bench_int4(bw, [1, 4, 16], [(14336, 4096), (4096, 14336)])
    if "moe" in only:
        lines += bench_moe(bw, flops, [1, 16, 64, 512, 4096], fp8=False)
        lines += bench_moe(bw, flops, [1, 64, 4096], fp8=True)
    header = (
        f"{'case':<38} {'dflt_us':>9} {'best_us':>9} {'base_us':>9} {'speedup':>7} {'best':>7} roof"
    )
    print("\n" + header)
    print("\n".join(lines))
    print("base: torch._scaled_mm (fp8), x @ w.t() in bf16 (int4), per-expert PyTorch loop (moe)")


if __name__ == "__main__":
    main()
