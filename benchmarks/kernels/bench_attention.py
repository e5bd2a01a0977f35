"""Benchmark the attention and small-op kernels against the roofline and torch.

    python3 benchmarks/kernels/bench_attention.py [--sweep] [--json PATH]
    python3 benchmarks/kernels/bench_attention.py --rope [--json PATH]

Decode attention is memory-bound: its ceiling is device-to-device copy bandwidth, measured
first (bytes read + written). Prefill is compute-bound: it is compared with torch SDPA (flash
backend) on the same shapes. Small ops are compared with torch eager (their references).
`--sweep` also times a grid of launch configs and prints the best of each kernel.

`--rope` times only a decode step's rotary, KV cache write and attention at Llama-3-8B shapes
(32 / 8 heads of 128, bf16, 16-token blocks), over batch sizes and contexts: the fused kernel
(`paged_attention_decode_rope`) beside the pair it replaces (`rotary_kv_cache_write` then
`paged_attention_decode`), each replayed in a CUDA graph as the engine's decode steps run.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch
from triton.testing import do_bench, do_bench_cudagraph

from llmfleet.kernels.paged_attention_decode import (
    DecodeConfig,
    choose_partitions,
    paged_attention_decode,
    paged_attention_decode_rope,
)
from llmfleet.kernels.paged_attention_prefill import PrefillConfig, paged_attention_prefill
from llmfleet.kernels.rms_norm import rms_norm, rms_norm_ref
from llmfleet.kernels.rotary import (
    Llama3RopeScaling,
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)
from llmfleet.kernels.rotary_kv_write import rotary_kv_cache_write
from llmfleet.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

DEV = "cuda"
BF16 = torch.bfloat16


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read + written."""
    src = torch.randn(2**29, device=DEV)  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def _paged_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int):
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    ids = list(range(sum(blocks)))
    random.Random(0).shuffle(ids)  # scattered blocks, as after a while of serving
    tables, used = [], 0
    for nb in blocks:
        tables.append(ids[used : used + nb])
        used += nb
    width = max(blocks)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    cache = torch.randn(2, sum(blocks), block_size, num_kv_heads, head_dim, device=DEV, dtype=BF16)
    return cache, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def bench_decode(sweep: bool, rows: list, best: dict) -> None:
    batch, ctx, heads, kv_heads, dim = 64, 4096, 32, 8, 128
    cache, bt, lens = _paged_cache([ctx] * batch, kv_heads, dim, 16)
    q = torch.randn(batch, heads, dim, device=DEV, dtype=BF16)
    out = torch.empty_like(q)
    nbytes = batch * ctx * kv_heads * dim * 2 * 2 + 2 * q.numel() * 2

    def run(cfg: DecodeConfig | None) -> float:  # None: the launcher's default
        return _ms(lambda: paged_attention_decode(q, cache, bt, lens, dim**-0.5, ctx, out, cfg))

    ms = run(None)
    rows.append(("decode b64 ctx4096 32/8x128", ms, nbytes / ms / 1e6, "GB/s"))
    if sweep:
        results = {}
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for ns in (2, 3, 4):
                    cfg = DecodeConfig(block_n=bn, num_warps=nw, num_stages=ns)
                    results[cfg] = run(cfg)
        top = min(results, key=results.get)
        for part in (256, 512, 1024, 2048, 4096):
            cfg = DecodeConfig(top.block_n, top.num_warps, top.num_stages, part)
            results[cfg] = run(cfg)
        cfg = min(results, key=results.get)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        auto = choose_partitions(batch, kv_heads, ctx, top.block_n, sms, top.min_partition)
        best["decode"] = {"config": repr(cfg), "ms": results[cfg], "auto_partition": auto}
        best["decode_all"] = {repr(k): v for k, v in sorted(results.items(), key=lambda kv: kv[1])}
        rows.append(("decode best-of-sweep", results[cfg], nbytes / results[cfg] / 1e6, "GB/s"))

    # Few long sequences: split-K is what keeps the GPU busy (run() reads the rebound names).
    batch, ctx = 4, 32768
    cache, bt, lens = _paged_cache([ctx] * batch, kv_heads, dim, 16)
    q = torch.randn(batch, heads, dim, device=DEV, dtype=BF16)
    out = torch.empty_like(q)
    nbytes = batch * ctx * kv_heads * dim * 2 * 2 + 2 * q.numel() * 2
    for label, part in (("split-K auto", None), ("one partition", ctx)):
        cfg = DecodeConfig(partition_size=part)
        ms = run(cfg)
        rows.append((f"decode b4 ctx32k {label}", ms, nbytes / ms / 1e6, "GB/s"))


ROPE_CASES = [(1, 1024), (1, 8192), (1, 32768), (8, 4096), (32, 4096), (64, 2048)]  # (b, ctx)


def _time_decode_rope(batch: int, ctx: int, cos_sin: torch.Tensor) -> tuple[float, float]:
    """(pair us, fused us) of one decode step: one new token per sequence at position
    ctx - 1, its slot in a scattered block table, the grid sized from ctx."""
    heads, kv_heads, dim = 32, 8, 128
    cache, bt, lens = _paged_cache([ctx] * batch, kv_heads, dim, 16)
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, device=DEV, dtype=BF16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # views, as the layer's
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=DEV)
    slots = bt[:, (ctx - 1) // 16].long() * 16 + (ctx - 1) % 16
    out = torch.empty_like(q)
    scale = dim**-0.5

    def pair() -> None:
        rotary_kv_cache_write(pos, q, k, v, cos_sin, cache, slots)
        paged_attention_decode(q, cache, bt, lens, scale, ctx, out)

    def fused() -> None:
        paged_attention_decode_rope(pos, q, k, v, cos_sin, cache, slots, bt, lens, scale, ctx, out)

    pair_ms = do_bench_cudagraph(pair, rep=100, return_mode="median")
    fused_ms = do_bench_cudagraph(fused, rep=100, return_mode="median")
    return pair_ms * 1e3, fused_ms * 1e3


def bench_decode_rope(best: dict) -> list[tuple[int, int, float, float]]:
    """(batch, context, pair us, fused us) per `ROPE_CASES` entry, Llama-3-8B shapes."""
    cos_sin = build_cos_sin_cache(128, 131072, 500000.0, Llama3RopeScaling(), device=DEV)
    results = [(b, c, *_time_decode_rope(b, c, cos_sin)) for b, c in ROPE_CASES]
    best["decode_rope"] = [
        {"batch": b, "ctx": c, "pair_us": p, "fused_us": f} for b, c, p, f in results
    ]
    return results


def print_decode_rope(results: list[tuple[int, int, float, float]]) -> None:
    print("decode step, rotary + KV write + attention (us, CUDA-graph replay)")
    print(f"{'batch':>5s} {'ctx':>6s} {'pair':>8s} {'fused':>8s} {'saved':>8s} {'speedup':>8s}")
    for batch, ctx, pair_us, fused_us in results:
        saved = pair_us - fused_us
        print(
            f"{batch:5d} {ctx:6d} {pair_us:8.2f} {fused_us:8.2f} {saved:8.2f} "
            f"{pair_us / fused_us:7.2f}x"
        )


def bench_prefill(sweep: bool, rows: list, best: dict) -> None:
    seqs, n, heads, dim = 4, 4096, 32, 128
    cache, bt, lens = _paged_cache([n] * seqs, heads, dim, 16)
    q = torch.randn(seqs * n, heads, dim, device=DEV, dtype=BF16)
    qsl = torch.arange(0, seqs * n + 1, n, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    flops = 4 * seqs * heads * n * n * dim / 2  # causal: half of QK^T and PV

    def run(cfg: PrefillConfig | None) -> float:  # None: the launcher's default
        return _ms(lambda: paged_attention_prefill(q, cache, qsl, lens, bt, dim**-0.5, n, out, cfg))

    qs = torch.randn(seqs, heads, n, dim, device=DEV, dtype=BF16)
    ks, vs = torch.randn_like(qs), torch.randn_like(qs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_ms = _ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        )
    rows.append(("prefill torch SDPA flash 4x4096", sdpa_ms, flops / sdpa_ms / 1e9, "TFLOP/s"))
    ms = run(None)
    rows.append(("prefill paged 4x4096 32x128", ms, flops / ms / 1e9, "TFLOP/s"))
    best["prefill_vs_sdpa"] = sdpa_ms / ms
    if sweep:
        results = {}
        for bm, bn, nw, ns in [
            (256, 64, 8, 3),
            (256, 64, 8, 2),
            (256, 64, 8, 4),
            (256, 32, 8, 3),
            (256, 32, 8, 4),
            (128, 64, 4, 3),
            (128, 32, 4, 2),
        ]:
            cfg = PrefillConfig(bm, bn, nw, ns)
            try:
                results[cfg] = run(cfg)
            except Exception as e:  # out of shared memory for this config: report, skip
                best.setdefault("prefill_failed", []).append(f"{cfg}: {type(e).__name__}")
        cfg = min(results, key=results.get)
        best["prefill"] = {"config": repr(cfg), "ms": results[cfg]}
        best["prefill_all"] = {repr(k): v for k, v in sorted(results.items(), key=lambda kv: kv[1])}
        rows.append(("prefill best-of-sweep", results[cfg], flops / results[cfg] / 1e9, "TFLOP/s"))


def bench_small(rows: list) -> None:
    tokens, hidden, inter = 16384, 4096, 14336
    x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
    res, w = torch.randn_like(x), torch.randn(hidden, device=DEV, dtype=BF16)
    nbytes = 4 * x.numel() * 2  # read x, residual; write out, new residual
    for name, fn in (("rms+res triton", rms_norm), ("rms+res torch", rms_norm_ref)):
        ms = _ms(lambda fn=fn: fn(x, w, 1e-5, res))
        rows.append((name, ms, nbytes / ms / 1e6, "GB/s"))
    g = torch.randn(tokens, 2 * inter, device=DEV, dtype=BF16)
    nbytes = g.numel() * 2 * 3 // 2
    for name, fn in (
        ("silu_and_mul triton", silu_and_mul),
        ("silu_and_mul torch", silu_and_mul_ref),
    ):
        ms = _ms(lambda fn=fn: fn(g))
        rows.append((name, ms, nbytes / ms / 1e6, "GB/s"))
    cache = build_cos_sin_cache(128, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (tokens,), device=DEV)
    q = torch.randn(tokens, 32, 128, device=DEV, dtype=BF16)
    k = torch.randn(tokens, 8, 128, device=DEV, dtype=BF16)
    nbytes = 2 * (q.numel() + k.numel()) * 2
    for name, fn in (("rotary triton", rotary_embedding), ("rotary torch", rotary_embedding_ref)):
        ms = _ms(lambda fn=fn: fn(pos, q, k, cache))
        rows.append((name, ms, nbytes / ms / 1e6, "GB/s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch configs")
    parser.add_argument("--json", help="write all numbers here")
    parser.add_argument(
        "--rope",
        action="store_true",
        help="only the decode step's rotary + attention: fused kernel against the pair",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[tuple[str, float, float, str]] = []
    best: dict = {"device": torch.cuda.get_device_name(0)}
    if args.rope:
        print(best["device"])
        print_decode_rope(bench_decode_rope(best))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(best, f, indent=1)
        return
    copy = copy_bandwidth()
    rows.append(("device copy (ceiling)", float("nan"), copy, "GB/s"))
    bench_decode(args.sweep, rows, best)
    bench_prefill(args.sweep, rows, best)
    bench_small(rows)
    print(f"{best['device']}")
    print(f"{'kernel':34s} {'ms':>9s} {'rate':>10s} {'unit':8s} {'of copy':>8s}")
    for name, ms, rate, unit in rows:
        frac = f"{rate / copy:8.0%}" if unit == "GB/s" else ""
        print(f"{name:34s} {ms:9.4f} {rate:10.1f} {unit:8s} {frac}")
    print(f"prefill / SDPA flash speed: {best['prefill_vs_sdpa']:.2f}x")
    if args.json:
        best["rows"] = rows
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)
    for key in ("decode", "prefill"):
        if key in best:
            print(f"best {key}: {best[key]}")


if __name__ == "__main__":
    main()
