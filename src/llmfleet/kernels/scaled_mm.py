"""W8A8 scaled GEMM (FP8 e4m3 or INT8): out = (A_q @ B_q^T) * a_scale[:, None] * b_scale[None, :].

Layouts:
    a_q     (M, K)  fp8/int8, unit stride along K (activations, per-token quantized)
    b_q     (N, K)  same dtype, unit stride along K (a linear layer's weight, as stored)
    a_scale (M,) or (M, 1) float32, or one element (per-tensor activations)
    b_scale (N,) or (N, 1) float32 (per output channel), or one element (per-tensor weights)
    out     (M, N)  bfloat16 or float16, contiguous

The dot accumulates in float32 (FP8) or int32 (INT8, exact); both scales are applied once, in the
epilogue. Small M is bandwidth-bound on reading B: the launcher then splits K across programs
(float32 partials summed afterwards) so that enough programs stream the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import shared_memory_per_program, sm90_or_later


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,  # elements between rows of A (M, K); A is unit-stride along K
    stride_bn,  # elements between rows of B (N, K); B is unit-stride along K
    stride_os,  # elements between split-K slices of out (0 when SPLIT_K == 1)
    stride_om,  # elements between rows of out (M, N); out is unit-stride along N
    A_SCALE_PER_ROW: tl.constexpr,
    B_SCALE_PER_COL: tl.constexpr,
    IS_INT8: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row-tiles share each column-tile of B while it sits in L2.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp out-of-range rows/cols to valid ones so loads need only a K mask; stores are masked.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N) = B^T tile

    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * tiles_per_split
    k_end = min(k_begin + tiles_per_split, k_tiles)
    a_ptrs += k_begin * BLOCK_K
    b_ptrs += k_begin * BLOCK_K
    for kt in range(k_begin, k_end):
        k_mask = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if IS_INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out = acc.to(tl.float32)
    if A_SCALE_PER_ROW:
        out = out * tl.load(a_scale_ptr + rows)[:, None]
    else:
        out = out * tl.load(a_scale_ptr)
    if B_SCALE_PER_COL:
        out = out * tl.load(b_scale_ptr + cols)[None, :]
    else:
        out = out * tl.load(b_scale_ptr)
    o_ptrs = (
        out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    )
    o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


# 3 stages of a 16 x 256 and a 128 x 256 byte tile, and room for the epilogue: sm_120 parts
# (99 KB per program) are sm_90 or later but cannot hold them
WIDE_TILE_SMEM = 3 * (16 + 128) * 256 + 16 * 1024


def wide_tiles_fit(device: torch.device) -> bool:
    """Whether `default_config` may take the wide decode tiles on `device`."""
    return sm90_or_later(device) and shared_memory_per_program(device) >= WIDE_TILE_SMEM


def default_config(m: int, n: int, k: int, wide_tiles: bool = False) -> MatmulConfig:
    """Block shapes by M (tuned with bench_matmul_moe): weight streaming with narrow-M tiles
    at decode sizes, large tiles (tensor-core bound) at prefill sizes.

    `wide_tiles` (Hopper-class parts with room for `WIDE_TILE_SMEM`): up to 8 rows, where
    64-column tiles alone cover the 132 SMs, 128-column tiles stream the weight faster. At 16
    rows the 64-column tile stays (the wide one gains nothing there), and narrower weights
    (fewer than 132 64-column tiles) keep it too."""
    if wide_tiles and m <= 8 and triton.cdiv(n, 64) >= 132:
        return MatmulConfig(16, 128, 256, split_k=1, num_warps=4, num_stages=3)
    if m <= 16:
        cfg = MatmulConfig(16, 64, 256, num_warps=4, num_stages=4)
    elif m <= 64:
        if n <= 8192:
            cfg = MatmulConfig(64, 32, 256, num_warps=4, num_stages=5)
        else:
            cfg = MatmulConfig(64, 128, 256, num_warps=8, num_stages=3)
    elif m <= 256:
        cfg = MatmulConfig(64, 128, 128, num_warps=4, num_stages=4)
    else:
        cfg = MatmulConfig(128, 256, 128, num_warps=8, num_stages=3)
    # At M <= 16, split K until the grid covers the machine (132 SMs) once.
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = 1
    while m <= 16 and tiles * split < 132 and split * 2 <= k_tiles // 4:
        split *= 2
    return MatmulConfig(**{**cfg.__dict__, "split_k": split})


def _scale_vector(s: torch.Tensor, n: int, name: str) -> tuple[torch.Tensor, bool]:
    if s.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {s.dtype}")
    if s.numel() == 1:
        return s.reshape(1).contiguous(), False
    if s.numel() != n:
        raise ValueError(f"{name} must have 1 or {n} elements, got {s.numel()}")
    return s.reshape(n).contiguous(), True


def scaled_mm(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """out (M, N) = (a_q (M, K) @ b_q (N, K)^T) * a_scale * b_scale, in `out_dtype`."""
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"shapes must be (M, K) and (N, K), got {a_q.shape} and {b_q.shape}")
    if a_q.dtype != b_q.dtype or a_q.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(
            f"a_q and b_q must both be float8_e4m3fn or int8: {a_q.dtype}, {b_q.dtype}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
    if a_q.stride(1) != 1 or b_q.stride(1) != 1:
        raise ValueError("a_q and b_q must be unit-stride along K")
    m, k = a_q.shape
    n = b_q.shape[0]
    a_s, a_per_row = _scale_vector(a_scale, m, "a_scale")
    b_s, b_per_col = _scale_vector(b_scale, n, "b_scale")
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, wide_tiles_fit(a_q.device))
    split = cfg.split_k
    target = (
        out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    )
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _scaled_mm_kernel[grid](
        a_q,
        b_q,
        target,
        a_s,
        b_s,
        m,
        n,
        k,
        a_q.stride(0),
        b_q.stride(0),
        m * n if split > 1 else 0,
        n,
        A_SCALE_PER_ROW=a_per_row,
        B_SCALE_PER_COL=b_per_col,
        IS_INT8=a_q.dtype == torch.int8,
        SPLIT_K=split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        out.copy_(target.sum(dim=0))
    return out


def scaled_mm_ref(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """PyTorch reference of `scaled_mm` (float64 products: exact for int8, near-exact for fp8)."""
    m, n = a_q.shape[0], b_q.shape[0]
    acc = a_q.double() @ b_q.double().t()
    a_s = a_scale.double().reshape(-1, 1) if a_scale.numel() == m else a_scale.double().reshape(())
    b_s = b_scale.double().reshape(1, -1) if b_scale.numel() == n else b_scale.double().reshape(())
    return (acc * a_s * b_s).to(out_dtype)
