"""The one-shot all-reduce (kernels/all_reduce.py) against NCCL on the GPUs of this host.

    python3 benchmarks/all_reduce_bench.py [--world 2] [--hidden 4096] [--calls 64]

One process a GPU (NCCL group). First correctness, every rank: the peer sum equals NCCL's bit
for bit (at two ranks both add once in float32 and round); the fused sum + residual + RMSNorm
gives NCCL's sum + the norm kernel's residual bits and its normed values; and CUDA graphs of
different row counts, replayed interleaved with eager calls on fresh inputs, keep agreeing
(the per-row call numbers and the two slots stay in step across graphs); a row-parallel
projection's GEMV that pushes its row into the peers' cells gives the same bits as one that
leaves the sending to the all-reduce, eager and in a graph. Then the time per call inside a
CUDA graph of `--calls` chained calls, each consuming the last one's output as a decode step's
layers do: NCCL all-reduce + the add-and-norm kernel (what a decoder layer ran before) against
the fused kernel, and the bare sums; and at one row, a (hidden x hidden) GEMV followed by the
fused call, with and without the push.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmfleet.kernels.all_reduce import PeerAllReduce, launch
from llmfleet.kernels.dispatch import decode_linear
from llmfleet.kernels.rms_norm import rms_norm

EPS = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_norm(x, w, res):
    dist.all_reduce(x)
    return rms_norm(x, w, EPS, res)


def check(peer: PeerAllReduce, hidden: int, rank: int) -> list[str]:
    """Eager and graphed calls against NCCL + the norm kernel; returns failures."""
    dev = peer.device
    bad = []
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    w = torch.randn(hidden, device=dev, dtype=torch.bfloat16, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 7, 16) if dtype == torch.bfloat16 else (1, 8):
            x = torch.randn(rows, hidden, device=dev, generator=gen).to(dtype)
            res = torch.randn(rows, hidden, device=dev, generator=gen).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            if not torch.equal(peer(x.clone()), want):
                bad.append(f"sum {dtype} rows {rows}")
            normed, total = peer(x.clone(), w.to(dtype), EPS, res)
            want_n, want_t = rms_norm(want.clone(), w.to(dtype), EPS, res)
            if not torch.equal(total, want_t):
                bad.append(f"residual {dtype} rows {rows}")
            if (normed.float() - want_n.float()).abs().max() > 0.02:
                bad.append(f"norm {dtype} rows {rows}")
    # graphs of 1 and 5 rows, each 6 chained fused calls, replayed interleaved with eager calls
    graphs = {}
    for rows in (1, 5):
        xs = [torch.zeros(rows, hidden, device=dev, dtype=torch.bfloat16) for _ in range(6)]
        res = torch.zeros(rows, hidden, device=dev, dtype=torch.bfloat16)
        outs = []
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            r = res
            for x in xs:  # warm-up (compiles), then capture
                _, r = peer(x, w, EPS, r)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            r = res
            for x in xs:
                n, r = peer(x, w, EPS, r)
                outs.append((n, r))
        graphs[rows] = (g, xs, res, outs)
    for it in range(60):
        rows = (1, 5)[it % 2]
        g, xs, res, outs = graphs[rows]
        for x in xs:
            x.copy_(torch.randn(x.shape, device=dev, generator=gen))
        res.copy_(torch.randn(res.shape, device=dev, generator=gen))
        g.replay()
        peer(torch.randn(3, hidden, device=dev, generator=gen).to(torch.bfloat16))  # eager
        dist.all_reduce(torch.zeros(1, device=dev))  # (keeps NCCL's count in step)
        r = res
        for x, (n, got_r) in zip(xs, outs, strict=True):
            want_n, r = nccl_norm(x.clone(), w, r)
            if not torch.equal(got_r, r) or (n.float() - want_n.float()).abs().max() > 0.02:
                bad.append(f"graph rows {rows} replay {it}")
                break
    return bad


def projected(peer: PeerAllReduce, proj: torch.Tensor, w: torch.Tensor, push: bool):
    """fn(x, r) of a decoder layer's row-parallel half at one row: r's projection (this
    rank's part), summed with the peers' + r, normalized; returns (normed, new residual)."""

    def fn(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = decode_linear(r, proj, push=peer if push else None)
        return peer(y, w, EPS, r)

    return fn


def check_push(peer: PeerAllReduce, hidden: int, rank: int) -> list[str]:
    """A pushing GEMV against one that is not: the same bits, eager and graphed."""
    dev = peer.device
    gen = torch.Generator(device=dev).manual_seed(2000 + rank)
    proj = torch.randn(hidden, hidden, device=dev, generator=gen).to(torch.bfloat16) / 64
    w = torch.randn(hidden, device=dev, generator=gen).to(torch.bfloat16)
    plain, pushing = projected(peer, proj, w, False), projected(peer, proj, w, True)
    bad = []
    r0 = torch.zeros(1, hidden, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        pushing(None, r0)  # warm-up (compiles)
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = pushing(None, r0)
    for it in range(20):
        r = torch.randn(1, hidden, device=dev, generator=gen).to(torch.bfloat16)
        want = plain(None, r)
        if not all(torch.equal(a, b) for a, b in zip(pushing(None, r), want, strict=True)):
            bad.append(f"pushed GEMV, eager, call {it}")
        r0.copy_(r)
        g.replay()
        if not all(torch.equal(a, b) for a, b in zip(graphed, want, strict=True)):
            bad.append(f"pushed GEMV, graphed, replay {it}")
    return bad


def time_graph(dev, calls: int, fn, rows: int, hidden: int) -> float:
    """Microseconds per call in a graph of `calls` chained calls of fn(x, residual)."""
    xs = [torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16) for _ in range(calls)]
    res0 = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            r = res0
            for x in xs:
                r = fn(x, r)
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r = res0
        for x in xs:
            r = fn(x, r)
    for _ in range(5):
        g.replay()
    dist.barrier()
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize(dev)
    return start.elapsed_time(end) * 1e3 / reps / calls


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev
    )
    peer = PeerAllReduce(None, dev)
    bad = check(peer, args.hidden, rank) + check_push(peer, args.hidden, rank)
    flags = [None] * world
    dist.all_gather_object(flags, bad)
    w = torch.randn(args.hidden, device=dev, dtype=torch.bfloat16)
    rows_out = []
    for rows in (1, 8, 16, 32, 64):
        fused = lambda x, r: launch(peer, x, w, EPS, r)[1]  # noqa: E731 (past `fits` too)
        t = {
            "NCCL + add&norm": time_graph(
                dev, args.calls, lambda x, r: nccl_norm(x, w, r)[1], rows, args.hidden
            ),
            "fused one-shot": time_graph(dev, args.calls, fused, rows, args.hidden),
            "NCCL sum": time_graph(
                dev, args.calls, lambda x, r: (dist.all_reduce(x), x)[1], rows, args.hidden
            ),
            "one-shot sum": time_graph(
                dev, args.calls, lambda x, r: launch(peer, x, None, EPS, None), rows, args.hidden
            ),
        }
        rows_out.append((rows, t))
    proj = torch.randn(args.hidden, args.hidden, device=dev).to(torch.bfloat16) / 64
    pushes = {}
    for name, push in (("GEMV, then the fused call", False), ("pushing GEMV, fused", True)):
        layer = projected(peer, proj, w, push)
        pushes[name] = time_graph(dev, args.calls, lambda x, r: layer(x, r)[1], 1, args.hidden)  # noqa: B023
    if rank == 0:
        print(f"\n== all-reduce, {world}x {torch.cuda.get_device_name(dev)}, hidden {args.hidden}")
        print("correctness:", "all equal" if not any(flags) else flags)
        names = list(rows_out[0][1])
        print(f"{'rows':>4} " + " ".join(f"{n:>16}" for n in names) + "  (us per call, graph)")
        for rows, t in rows_out:
            line = " ".join(f"{t[n]:16.2f}" for n in names)
            gain = t["NCCL + add&norm"] / t["fused one-shot"]
            print(f"{rows:4d} {line}  fused {gain:.2f}x faster")
        print(f"one row after a {args.hidden}x{args.hidden} bf16 GEMV (us per pair, graph):")
        for name, t in pushes.items():
            print(f"  {name:<28} {t:8.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--calls", type=int, default=64)
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(rank_main, args=(args.world, free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
