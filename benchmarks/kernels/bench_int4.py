"""INT4 weight-only GEMM at decode sizes: correctness and a sweep of kernel variants vs bf16.

    python3 benchmarks/kernels/bench_int4.py [--quick] [--budget SECONDS]

For every shape (N, K) (default: a 4096 x 14336 weight in both orientations; `--shapes`) and
M (default 1, 4, 16; `--ms`: above 16 the default path is 16-row `int4_gemv` chunks up to
`gemv_chunks_up_to`, and `--old-tiles` times the tile kernel beside it), each
candidate is first checked against the float32 reference (dequantize, then matmul) on fresh
random data, twice (a race between the splits of K would show as a moving error), and the
split-K arrival counters (and `int4_gemv`'s atomically added sums) must be all zeros
afterwards. Then it is timed as the median of
CUDA-graph replays. The weights rotate over enough copies to exceed L2 (a 4096 x 14336 INT4
weight is 31 MB and would otherwise stay in a 50 MB L2 between replays), and the bf16 baseline
`x @ w.t()` rotates the same way. GB/s counts weight, scales, zeros, x and out once.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton

from llmfleet.kernels import int4_gemv as gv
from llmfleet.kernels import int4_matmul as i4
from llmfleet.kernels import int4_mma as mma
from llmfleet.kernels import int4_pack as ip
from llmfleet.kernels.triton_utils import even_split

ROTATE_BYTES = 200 << 20  # more than twice the L2 of an H100/H200


def bench(fn) -> float:
    """Median microseconds per call over CUDA-graph replays."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def rotating(make, nbytes: int):
    """Copies of `make()` enough to exceed ROTATE_BYTES, and a cycling picker over them."""
    copies = [make() for _ in range(max(2, -(-ROTATE_BYTES // nbytes)))]
    it = itertools.cycle(copies)
    return copies, lambda: next(it)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(run, weights, m: int, k: int, dtype: torch.dtype, group: int) -> float:
    """Worst relative error of `run(x, qw, s, z)` over two fresh inputs; NaN-poisoned outputs
    are caught by the isnan check (the launcher allocates with empty, so unwritten -> garbage)."""
    worst = 0.0
    for _ in range(2):
        qw, s, z = weights
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = ip.int4_matmul_ref(x, qw, s, z, group).float()
        out = run(x, qw, s, z)
        torch.cuda.synchronize()
        worst = max(worst, rel_err(out, ref))
    for ws, cnt in gv._WORKSPACE._by_device.values():
        if ws.abs().max().item() != 0 or cnt.abs().max().item() != 0:
            return float("inf")  # the workspace was not re-armed
    for _, cnt in mma._WORKSPACE._by_device.values():  # its sums are scratch, not re-armed
        if cnt.abs().max().item() != 0:
            return float("inf")
    return worst


def gemv_candidates(m: int, n: int, k: int, group: int) -> list[gv.GemvConfig | mma.MmaConfig]:
    """A few block shapes of the kernels that serve M, each split to about the given numbers
    of programs per SM of a 132-SM part (fewer for groups under 128: a second look); also
    the Gluon mma.sync kernel's shapes where it runs, with scales before and after the dot."""
    if m == 1:  # (block_n, block_kp, warps, programs per SM), CUDA-core kernel
        shapes = [(64, 16, 4, (7, 4, 12)), (64, 32, 4, (7,)), (128, 16, 8, (4, 7))]
        shapes.append((64, 8, 4, (7,)))
    else:  # tensor-core kernel
        shapes = [(64, 16, 4, (3, 2, 4)), (128, 16, 4, (3, 2)), (64, 32, 4, (3,))]
    out = []
    for bn, bkp, warps, per_sms in shapes:
        for per_sm in per_sms if group >= 128 else per_sms[:1]:
            split = gv.split_k(m, n, k, bn, bkp, per_sm)
            for packed in (True, False) if m == 1 else (False,):  # bf16x2 or float32 products
                cfg = gv.GemvConfig(bn, bkp, split, m > 1, warps, 3 if m > 1 else 1, packed)
                if cfg not in out:
                    out.append(cfg)
    if mma.mma_supported(torch.bfloat16):  # Gluon mma.sync: (warps, rep, blocks)
        for warps, rep, blocks in [(2, 2, 4), (1, 2, 4), (4, 2, 4), (4, 1, 4), (4, 2, 2)]:
            out.append(mma.MmaConfig(warps, rep, blocks))  # split: one wave of what fits
            for regs in (128, 0):  # scales after the dot, with and without a register limit
                out.append(mma.MmaConfig(warps, rep, blocks, 0, True, regs))
    if m > 1 and mma.mma_supported(torch.bfloat16):
        shape = mma.MmaConfig(2, 2, 4)
        for per_sm in (4, 8):  # the alternative to wave_split: fixed programs per SM
            split = even_split(shape.steps(k), triton.cdiv(n, shape.block_n), per_sm)
            out.append(mma.MmaConfig(2, 2, 4, split))
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (after warming the clocks)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    triton.testing.do_bench(lambda: a @ a, warmup=300, rep=300)
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src)) * 1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="group 128 only, default configs only")
    p.add_argument("--budget", type=float, default=200.0, help="seconds for the sweep")
    p.add_argument("--log", default=None, help="append every row to this file")
    p.add_argument("--old-tiles", action="store_true", help="also time the M > 16 tile kernel")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16], help="M values (1 4 16)")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["14336x4096", "4096x14336"],
        help="weights as NxK (default: 14336x4096 4096x14336)",
    )
    p.add_argument("--groups", type=int, nargs="+", help="group sizes (default 128 32)")
    args = p.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    log = open(args.log, "a") if args.log else None
    rows: list[str] = []

    def emit(line: str) -> None:
        rows.append(line)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    header = f"{'M':>3} {'N':>6} {'K':>6} {'G':>4} {'variant':<34} {'us':>7} {'GB/s':>6}"
    header += f" {'vs bf16':>7} err"
    emit(header)
    groups = args.groups or ([128] if args.quick else [128, 32])
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    dtype = torch.bfloat16
    for group, (n, k) in itertools.product(groups, shapes):
        wbytes = k * n // 2 + 2 * (k // group) * n * 2
        copies, pick = rotating(lambda: ip.random_int4(k, n, group, dtype), wbytes)  # noqa: B023
        dense = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(2)]
        dit = itertools.cycle(dense)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            base = bench(lambda: x @ next(dit).t())  # noqa: B023
            nbytes = wbytes + 2 * m * (k + n)

            def row(name: str, us: float, err: float, nb: int = nbytes) -> None:  # noqa: B008
                emit(
                    f"{m:>3} {n:>6} {k:>6} {group:>4} {name:<34} {us:>7.1f}"  # noqa: B023
                    f" {nb / (us * 1e-6) / 1e9:>6.0f} {base / us:>6.2f}x {err:.1e}"  # noqa: B023
                )

            row("bf16 x @ w.t()", base, 0.0, 2 * n * k + 2 * m * (k + n))
            variants: list[tuple[str, object]] = [("default", None)]
            if args.old_tiles:
                variants.append(("old-tiles", i4.default_config(m, n, k, group)))
            if not args.quick:
                variants += [(str(c), c) for c in gemv_candidates(m, n, k, group)]
            best = None
            for name, cfg in variants:
                if time.perf_counter() - start > args.budget and name != "default":
                    break
                if cfg is None:
                    run = lambda x, q, s, z: i4.int4_matmul(x, q, s, z, group)  # noqa: B023, E731
                elif isinstance(cfg, i4.Int4Config):
                    run = lambda x, q, s, z, c=cfg: i4.int4_matmul(x, q, s, z, group, c)  # noqa: B023, E731
                else:
                    run = lambda x, q, s, z, c=cfg: gv.int4_gemv(x, q, s, z, group, c)  # noqa: B023, E731
                try:
                    err = check(run, copies[0], m, k, dtype, group)
                    if not err < 1e-2:
                        row(name, float("nan"), err)
                        continue
                    us = bench(lambda: run(x, *pick()))  # noqa: B023
                except Exception as exc:  # a candidate may not compile or fit
                    emit(f"  skip {name}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                row(name, us, err)
                if isinstance(cfg, (gv.GemvConfig, mma.MmaConfig)) and (
                    best is None or us < best[0]
                ):
                    best = (us, name)
            if m in (1, 16):  # float16 activations through the default path
                qh, sh, zh = (t.half() if t.is_floating_point() else t for t in copies[0])
                err16 = check(
                    lambda x, q, s, z: i4.int4_matmul(x, q, s, z, group),  # noqa: B023
                    (qh, sh, zh), m, k, torch.float16, group,
                )  # fmt: skip
                row("default float16 (check only)", float("nan"), err16)
            if best:
                emit(f"  best M={m} N={n} K={k} G={group}: {best[1]} {best[0]:.1f} us "
                     f"({base / best[0]:.2f}x bf16)")  # fmt: skip
        del copies, dense
        torch.cuda.empty_cache()
    print("\n" + "\n".join([header] + [r for r in rows if "best" in r or "default" in r]))
    print(f"elapsed {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
