"""INT4 weight-only GEMM with per-(group, column) scales and zero points: out = x @ W.

The weight layout (kernels/int4_pack.py, which also packs GGUF Q4_0/Q4_1 and holds the PyTorch
reference) for W of logical shape (K, N) = (in_features, out_features):

    qweight (K // 8, N) int32   8 nibbles per word, packed along K: nibble j of qweight[i, n]
                                 is q[8 i + j, n], q in 0..15
    scales  (K // G, N)          float16/bfloat16, one per group of G consecutive k and column n
    zeros   (K // G, N)          same dtype: the zero point already multiplied by the scale

    W[k, n] = q[k, n] * scales[k // G, n] - zeros[k // G, n]

    x   (M, K) float16/bfloat16, unit stride along K;  out (M, N) in x's dtype.

Decode (M <= 16) is bound by reading qweight (K N / 2 bytes), a quarter of a bf16 weight: the
launcher hands it to `int4_gemv` (split-K, nibbles consumed in place, one launch), and a
little larger M (a decode step of a few more sequences, or a sequence with its drafts) to
`int4_gemv` on 16 rows at a time (`gemv_chunks_up_to`). Larger M runs the tensor-core tiles
below, which dequantize a (BLOCK_K, BLOCK_N) tile per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.int4_gemv import MAX_M as GEMV_MAX_M
from llmfleet.kernels.int4_gemv import int4_gemv
from llmfleet.kernels.int4_pack import GROUP_SIZES


@dataclass(frozen=True)
class Int4Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # Load each word once and reshape nibbles (False), or one word load per k row (True): the
    # per-row loads are much slower and stay only as a tested alternative.
    unpack_by_load: bool = False


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,  # elements between rows of x (M, K); x is unit-stride along K
    stride_qk,  # int32 words between packed rows of qweight (K // 8, N); unit-stride along N
    stride_sg,  # elements between group rows of scales and zeros (K // G, N); unit-stride along N
    stride_os,  # elements between split-K slices of out (0 when SPLIT_K == 1)
    stride_om,  # elements between rows of out (M, N); unit-stride along N
    GROUP_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # float32 dot: the CPU interpreter mis-multiplies bfloat16
    UNPACK_BY_LOAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    # Groups per K tile (1 when the tile lies inside one group: BLOCK_K <= GROUP_SIZE).
    NUM_G: tl.constexpr = BLOCK_K // GROUP_SIZE if BLOCK_K > GROUP_SIZE else 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // 8)  # packed rows in a K tile
    offs_g = tl.arange(0, NUM_G)
    shifts = tl.arange(0, 8) * 4

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * tiles_per_split
    k_end = min(k_begin + tiles_per_split, k_tiles)
    for kt in range(k_begin, k_end):
        k0 = kt * BLOCK_K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=(k0 + offs_k)[None, :] < K,
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        if UNPACK_BY_LOAD:
            # Each k row loads its own word (8 rows share one: L1 hits), then shifts out its
            # nibble: no register reshuffle, the tile lands directly in a (BK, BN) layout.
            kk = k0 + offs_k
            packed = tl.load(
                qw_ptr + (kk // 8)[:, None].to(tl.int64) * stride_qk + cols[None, :],
                mask=(kk < K)[:, None],
                other=0,
            )
            qf = ((packed >> ((kk % 8) * 4)[:, None]) & 0xF).to(tl.float32)  # (BK, BN)
            if BLOCK_K <= GROUP_SIZE:
                g_off = (k0 // GROUP_SIZE).to(tl.int64) * stride_sg + cols
                s = tl.load(scales_ptr + g_off).to(tl.float32)[None, :]
                z = tl.load(zeros_ptr + g_off).to(tl.float32)[None, :]
            else:
                g_off = (kk // GROUP_SIZE)[:, None].to(tl.int64) * stride_sg + cols[None, :]
                s = tl.load(scales_ptr + g_off, mask=(kk < K)[:, None], other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + g_off, mask=(kk < K)[:, None], other=0.0).to(tl.float32)
            w = qf * s - z
        else:
            # Load each word once as (BK // 8, BN), expand to (BK // 8, 8, BN) nibbles, reshape.
            p_rows = k0 // 8 + offs_p
            packed = tl.load(
                qw_ptr + p_rows[:, None].to(tl.int64) * stride_qk + cols[None, :],
                mask=p_rows[:, None] < K // 8,
                other=0,
            )
            q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
            g_rows = k0 // GROUP_SIZE + offs_g
            sz_off = g_rows[:, None].to(tl.int64) * stride_sg + cols[None, :]
            sz_mask = g_rows[:, None] < K // GROUP_SIZE
            s = tl.load(scales_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
            qg = tl.reshape(q, (NUM_G, BLOCK_K // NUM_G, BLOCK_N)).to(tl.float32)
            w = tl.reshape(qg * s[:, None, :] - z[:, None, :], (BLOCK_K, BLOCK_N))
        if UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc)
        else:
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)

    o_ptrs = (
        out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    )
    o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gemv_chunks_up_to(n: int, k: int) -> int:
    """The largest M that runs as `int4_gemv` calls of 16 rows each rather than as the tiles
    here. Measured on an H200 (benchmarks/kernels/bench_int4.py --old-tiles, bf16, group 32,
    weights past L2; docs/benchmarks.md): two chunks beat the tiles (split-K partial sums, then
    a reduction) at every shape from SmolLM2-135M's to Llama-3-8B's, 7.7-9.0 against
    12.6-14.1 us for SmolLM2 and 19.5-74 against 54-216 us for 8B at M = 17..32; three chunks
    still win for 8B-sized weights (31-111 against 48-166 us at M = 48), not for SmolLM2's."""
    return 3 * GEMV_MAX_M if n * k >= 4096 * 4096 else 2 * GEMV_MAX_M


def default_config(m: int, n: int, k: int, group_size: int) -> Int4Config:
    """Block shapes by M (tuned with bench_matmul_moe): at decode sizes
    narrow-M tiles streaming the packed weight, split over K to about 1.5 waves of 132 SMs;
    wider tensor-core tiles for prefill. BLOCK_K divides or is a multiple of the group size."""
    if m <= 16:
        cfg = Int4Config(16, 128, 128) if n >= 8192 else Int4Config(16, 64, 256)
    elif m <= 64:
        cfg = Int4Config(64, 64, 128)
    else:
        cfg = Int4Config(128, 128, 64, num_warps=8, num_stages=3)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = 1
    while m <= 64 and tiles * split < 200 and split * 2 <= k_tiles // 2:
        split *= 2
    return Int4Config(
        cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages, False
    )


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    config: Int4Config | None = None,
) -> torch.Tensor:
    """out (M, N) = x (M, K) @ W (K, N), W unpacked from the layout in the module docstring.

    Without an explicit `config`, M <= 16 runs `int4_gemv`, and M up to `gemv_chunks_up_to`
    runs it on 16 rows at a time; a config forces these tiles."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a 2-D float16/bfloat16 tensor, got {x.dtype} {x.shape}")
    m, k = x.shape
    if k % group_size != 0:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight must be int32 (K // 8, N) = ({k // 8}, N), got {qweight.shape}")
    n = qweight.shape[1]
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (k // group_size, n) or t.dtype != x.dtype:
            raise ValueError(f"{name} must be {x.dtype} ({k // group_size}, {n}), got {t.shape}")
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be unit-stride along N")
    if scales.stride(0) != zeros.stride(0):
        raise ValueError("scales and zeros must share a row stride")
    if x.stride(1) != 1 or qweight.stride(1) != 1:
        raise ValueError("x must be unit-stride along K and qweight along N")
    if config is None and m <= GEMV_MAX_M:
        return int4_gemv(x, qweight, scales, zeros, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if config is None and m <= gemv_chunks_up_to(n, k):
        for i in range(0, m, GEMV_MAX_M):  # each chunk's rows of out, in place
            int4_gemv(x[i : i + GEMV_MAX_M], qweight, scales, zeros, group_size, out=out[i:])
        return out
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, group_size)
    if not (cfg.block_k % group_size == 0 or group_size % cfg.block_k == 0) or cfg.block_k < 8:
        raise ValueError(f"block_k={cfg.block_k} must divide or be a multiple of {group_size}")
    split = cfg.split_k
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _int4_matmul_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        target,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        m * n if split > 1 else 0,
        n,
        GROUP_SIZE=group_size,
        SPLIT_K=split,
        UPCAST_DOT=_interpreting(),
        UNPACK_BY_LOAD=cfg.unpack_by_load,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        out.copy_(target.sum(dim=0))
    return out
