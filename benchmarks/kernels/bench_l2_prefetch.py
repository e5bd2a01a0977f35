"""Weight prefetch into L2 across a short kernel: what it saves the projection after it.

    python3 benchmarks/kernels/bench_l2_prefetch.py [--gaps 0 3 6 9] [--fractions 0 .1 .2 .3 .5]

A decode step alternates weight streams (the GEMVs) with short kernels that read almost nothing
(an all-reduce with its norm, rotary and attention). This program times the pattern

    GEMV (the previous projection) -> [prefetch of the next weight] -> wait T us -> GEMV (next)

in a CUDA graph under PDL, as the engine launches it, with the weights rotating over copies
that exceed L2 (so only the prefetch can put them there). "wait" is one program spinning on
the global timer for T us: a stand-in for the short kernels, which leave memory idle the same
way. For each next projection (Llama-3-8B at TP=2: q/k/v, o, the fused gate/up), each gap and
each prefetch size (a fraction of this GPU's L2) it prints the time of one pattern and what the
prefetch saved against no prefetch, next to the next GEMV's own time at the copy rate.
The outputs are checked equal with and without the prefetch (it is only a hint).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_attention import copy_bandwidth
from bench_int4 import bench

from llmfleet.kernels import l2_prefetch as l2
from llmfleet.kernels.gemv import gated_config, gemv
from llmfleet.kernels.triton_utils import pdl, pdl_start

ROTATE_BYTES = 1 << 30
SHAPES = {  # (N, K, gated) of the weight after the gap; Llama-3-8B's at TP=2
    "q/k/v": (3072, 4096, False),
    "o": (4096, 2048, False),
    "gate/up": (14336, 4096, True),
}


@triton.jit
def _now(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,l", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin_kernel(t_ns, PDL: tl.constexpr):
    pdl_start(PDL)
    start = _now(t_ns)
    now = start
    while now - start < t_ns:
        now = _now(t_ns)


def spin(us: float, device: torch.device) -> None:
    chained = pdl(device)
    _spin_kernel[(1,)](int(us * 1e3), PDL=chained, num_warps=1, launch_pdl=chained)


def params(n: int, k: int, copies: int) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for _ in range(copies)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 4.0, 8.0])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3])
    p.add_argument("--modes", nargs="+", default=["1:1024:128"], help="MODE:LANES:CHUNK")
    args = p.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth()
    l2_bytes = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, L2 {l2_bytes >> 20} MiB")
    gate_up = (14336, 4096)
    prev = params(*gate_up, -(-ROTATE_BYTES // (gate_up[0] * gate_up[1] * 2)))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    prev_cfg = gated_config(*gate_up, x.dtype, dev)
    rows = []
    modes = [tuple(int(v) for v in m.split(":")) for m in args.modes]
    for name, (n, k, gated) in SHAPES.items():
        nbytes = n * k * 2
        nxt = params(n, k, max(2, -(-ROTATE_BYTES // nbytes)))
        xn = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = gated_config(n, k, x.dtype, dev) if gated else None
        alone = bench(lambda: [gemv(xn, w, None, cfg, gated=gated) for w in nxt]) / len(nxt)  # noqa: B023
        outs: dict[tuple, torch.Tensor] = {}
        for mode, lanes, chunk in modes:
            issue = bench(
                lambda: [
                    l2.prefetch_l2(w, int(l2_bytes * 0.1), gated, mode, lanes, chunk)  # noqa: B023
                    for w in nxt  # noqa: B023
                ]
            ) / len(nxt)
            print(
                f"{name} mode {mode}:{lanes}:{chunk}: one prefetch of 0.1 L2 takes {issue:.2f} us"
            )
            for gap in args.gaps:
                base = None
                for frac in args.fractions:
                    reps = max(len(prev), len(nxt))

                    def pattern(frac=frac, gap=gap, reps=reps, m=(mode, lanes, chunk)) -> None:
                        for i in range(reps):  # every copy once per call: nothing stays in L2
                            gemv(x, prev[i % len(prev)], None, prev_cfg, gated=True)
                            w = nxt[i % len(nxt)]  # noqa: B023
                            if frac > 0:
                                l2.prefetch_l2(w, int(l2_bytes * frac), gated, *m)  # noqa: B023
                            if gap > 0:
                                spin(gap, dev)
                            out = gemv(xn, w, None, cfg, gated=gated)  # noqa: B023
                        outs[(m, frac)] = out  # noqa: B023

                    us = bench(pattern) / reps
                    base = us if base is None else base
                    tag = f"{mode}:{lanes}:{chunk}"
                    rows.append((name, tag, gap, frac, us, base - us, alone, nbytes / alone / 1e3))
        first = next(iter(outs.values()))
        same = all(torch.equal(o, first) for o in outs.values())
        print(f"{name}: outputs equal with and without prefetch: {same}")
    print(f"\n{'next':8} {'mode':>10} {'gap us':>6} {'L2 frac':>7} {'pattern us':>10} "
          f"{'saved us':>8} {'next alone us':>13} {'GB/s':>6}")  # fmt: skip
    for name, tag, gap, frac, us, saved, alone, bw in rows:
        print(f"{name:8} {tag:>10} {gap:6.1f} {frac:7.2f} {us:10.2f} {saved:8.2f} "
              f"{alone:13.2f} {bw:6.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
