"""Greedy sampling's argmax over a vocabulary: the two-pass Triton argmax against torch's.

    python3 benchmarks/kernels/bench_argmax.py [--vocab 128256] [--rows 1 4 16 64]

Fresh random float32 logits per row count (a tie planted across pieces); each result checked
equal to torch.argmax first, then timed as the median of CUDA-graph replays with PDL off, like
torch's kernel. Bandwidth counts the logits read once, against the device-to-device copy rate
measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import copy_bandwidth
from bench_int4 import bench

from llmfleet.kernels.argmax import CHUNK, argmax
from llmfleet.kernels.triton_utils import programmatic_launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    args = ap.parse_args()
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy:.0f} GB/s, vocab {args.vocab}")
    print(f"{'rows':>4} {'torch us':>9} {'ours us':>8} {'%copy':>6} {'speed-up':>8}")
    with programmatic_launch(False):
        for rows in args.rows:
            x = torch.randn(rows, args.vocab, device="cuda")
            x[:, [3, CHUNK + 3]] = 100.0  # a tie across pieces: the lower index wins
            if not torch.equal(argmax(x), x.argmax(dim=-1)):
                raise SystemExit(f"rows {rows}: differs from torch.argmax")
            ours = bench(lambda x=x: argmax(x))
            theirs = bench(lambda x=x: x.argmax(dim=-1))
            pct = 100 * x.numel() * 4 / ours / 1e3 / copy
            print(f"{rows:4d} {theirs:9.1f} {ours:8.1f} {pct:5.0f}% {theirs / ours:7.1f}x")


if __name__ == "__main__":
    main()
