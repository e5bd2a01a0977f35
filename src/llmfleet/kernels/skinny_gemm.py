"""Linear layer for a few 16-bit rows (decode batches of 2..64): out = x @ W^T [+ bias].

    x (M, K) · W (N, K)^T [+ bias (N,)]  ->  out (M, N),   1 <= M <= MAX_M

At decode sizes a linear layer is still a stream over its weight, and cuBLAS does not stream
every shape at the copy rate (Llama-3-8B's square o projection and its down projection fall
well short of it). This kernel swaps the
operands so that the weight is the tensor-core MMA's wide side: each program computes a
(BLOCK_N, BLOCK_M) tile of out^T as W_tile (BLOCK_N, BLOCK_K) · x_tile^T (BLOCK_K, BLOCK_M),
with BLOCK_M the batch rounded up to a power of two (16 at least), so a batch of 4 does not
pay for 64 padded rows. Weight tiles stream through the software pipeline, evict-first.

Shapes with too few column tiles to fill the GPU split K. The splits meet without atomics on
the output: each stores its float32 partial tile into a workspace and counts itself in on its
column tile's arrival counter; the last to arrive adds the partial tiles in split order
(deterministic: reruns are bit-identical), adds the bias, writes the output and re-arms the
counter.

It does not win everywhere (cuBLAS is as fast on the wide q/k/v and gate/up shapes), so the
model's linear layer runs it only where this device's tuned file (`bench_gemv --save`) has an
entry for the shape and batch bucket; elsewhere, and on untuned devices, it keeps cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.gemv import check_out, out_columns, swiglu_tail
from llmfleet.kernels.silu_and_mul import silu_mul_rounded
from llmfleet.kernels.triton_utils import (
    ZeroedWorkspace,
    check_last_dim_contiguous,
    even_split,
    interpreting,
    launchable,
    pdl,
    pdl_start,
)
from llmfleet.kernels.tuned_configs import TunedConfigs

MAX_M = 64
_WORKSPACE = ZeroedWorkspace("skinny_gemm split-K")


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # rows of W (columns of out) per program
    block_k: int  # K per pipeline step
    split_k: int = 1  # programs per column tile, each over a contiguous K range
    num_warps: int = 4
    num_stages: int = 4


# Keys (N, K, M rounded up to a power of two); null where cuBLAS won. `bench_gemv --save`.
TUNED = TunedConfigs("skinny_gemm", SkinnyConfig)
# The gated variant's, keyed by the fused [gate | up] weight's (2I, K, M bucket); block_n
# counts rows per half; null where cuBLAS followed by `silu_and_mul` won.
TUNED_SILU = TunedConfigs("skinny_gemm_silu", SkinnyConfig)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # (M, K), unit stride along K
    w_ptr,  # (N, K), or (2N, K) = [gate | up] when GATED; unit stride along K
    bias_ptr,  # (N,) or (2N,) when GATED, or a dummy when not HAS_BIAS
    out_ptr,  # (M, N), unit stride along N
    ws_ptr,  # float32 partial tiles (column tiles, split_k, ACCS, BLOCK_N, BLOCK_M); if SPLIT
    cnt_ptr,  # int32 arrival counters, one per column tile, zero between calls
    M,
    N,  # output columns
    K,
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of W
    stride_om,  # elements between rows of out
    k_per_split,  # K elements per split, a multiple of BLOCK_K
    split_k,  # programs per column tile (grid dimension 1)
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the loop
    SPLIT: tl.constexpr,  # split_k > 1
    GATED: tl.constexpr,  # out = silu(x . gate^T) * (x . up^T): a second accumulator
    ROUND: tl.constexpr,  # out is wider than x: round the result to x's dtype first
    UPCAST: tl.constexpr,  # float32 dot (the CPU interpreter has no 16-bit dot)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamped: loads need no row mask
    x_rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_lo + offs_k)[None, :]  # (BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + x_rows[None, :] * stride_xm + (k_lo + offs_k)[:, None]  # (BLOCK_K, BLOCK_M)
    u_ptrs = w_ptr + (w_rows + N)[:, None] * stride_wn + (k_lo + offs_k)[None, :]  # GATED
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T tile
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED: the up half's
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            xt = tl.load(x_ptrs)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _mma(w, xt, acc, UPCAST)
        if GATED:
            if EVEN_K:
                u = tl.load(u_ptrs, eviction_policy="evict_first")
            else:
                u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            acc_up = _mma(u, xt, acc_up, UPCAST)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT:
        tile = BLOCK_N * BLOCK_M
        accs = 2 if GATED else 1
        idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        parts = ws_ptr + pid_n.to(tl.int64) * split_k * accs * tile
        tl.store(parts + pid_k * accs * tile + idx, acc)
        if GATED:
            tl.store(parts + (pid_k * accs + 1) * tile + idx, acc_up)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == split_k - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j in range(split_k):  # split order: deterministic
                acc += tl.load(parts + j * accs * tile + idx, cache_modifier=".cg")  # other SMs'
                if GATED:
                    acc_up += tl.load(parts + (j * accs + 1) * tile + idx, cache_modifier=".cg")
            _store_out(acc, acc_up, x_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                       HAS_BIAS, GATED, ROUND)  # fmt: skip
            tl.store(cnt_ptr + pid_n, 0)
    else:
        _store_out(acc, acc_up, x_ptr, bias_ptr, out_ptr, offs_n, offs_m, M, N, stride_om,
                   HAS_BIAS, GATED, ROUND)  # fmt: skip


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b on the tensor cores (float32 operands where the interpreter needs them)."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


@triton.jit
def _store_out(
    acc,
    acc_up,
    x_ptr,
    bias_ptr,
    out_ptr,
    offs_n,
    offs_m,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ROUND: tl.constexpr,
):
    """out[m, n] = acc[n, m] (+ bias[n]), or the SwiGLU of the gate and up sums when GATED,
    for the rows and columns that exist."""
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    if GATED:
        if HAS_BIAS:
            acc_up += tl.load(bias_ptr + N + rows).to(tl.float32)[:, None]
        acc = silu_mul_rounded(acc, acc_up, x_ptr.dtype.element_ty)
    if ROUND:
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_m < M)[None, :])


def block_m(m: int) -> int:
    """The batch rounded up to the tensor-core tile: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(m))


def default_config(m: int, n: int, k: int, gated: bool = False) -> SkinnyConfig:
    """For a call with no config whose shape (n output columns) has no tuned entry: 128 weight
    rows per program (gated: 64 from each half, the same shared memory), split to about one
    program per SM of a 132-SM part. The fastest candidate varies with the shape and the
    batch, so this is a fallback that is close at small batches and further off at large
    ones; tuned files hold the rest (`bench_gemv --save`, `--gated`)."""
    rows = 64 if gated else 128
    return SkinnyConfig(rows, 128, even_split(triton.cdiv(k, 128), triton.cdiv(n, rows), 1))


def m_bucket(m: int) -> int:
    """The batch size a tuned entry is measured at: M rounded up to a power of two."""
    return triton.next_power_of_2(m)


def choose(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, gated: bool = False
) -> SkinnyConfig | None:
    """This device's tuned config for the shape (N = the weight's rows), or None where cuBLAS
    (and, gated, the `silu_and_mul` kernel after it) was as fast or faster or nothing was
    tuned: the caller then runs `F.linear`."""
    if not 2 <= m <= MAX_M:
        return None
    return (TUNED_SILU if gated else TUNED).get(device, dtype, (n, k, m_bucket(m)), None)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {MAX_M}, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (N, {x.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x and weight must share a 16-bit dtype, got {x.dtype}, {weight.dtype}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight must have 2 * I rows [gate | up], got {weight.shape[0]}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({weight.shape[0]},) {x.dtype}, got {tuple(bias.shape)}")


def skinny_gemm(
    x: torch.Tensor,  # (M, K) fp16/bf16, unit stride along K
    weight: torch.Tensor,  # (N, K), x's dtype, unit stride along K; (2I, K) [gate | up] if gated
    bias: torch.Tensor | None = None,  # (N,)
    config: SkinnyConfig | None = None,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,  # (M, N or I), x's dtype or (not gated) float32
) -> torch.Tensor:
    """Triton x @ weight.T (+ bias) for 1 <= M <= MAX_M rows: `F.linear`'s function.
    `gated`: silu(x @ gate.T) * (x @ up.T) instead, (M, I), where `config.block_n` counts the
    rows each program takes from each half. A float32 `out` gets the values rounded to x's
    dtype first, as `F.linear(x, weight).float()` has them."""
    _check(x, weight, bias, gated)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    m, k = x.shape
    n = out_columns(weight, gated)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_out(out, x, n, gated)
    if n == 0:
        return out
    if k == 0:
        y = weight.new_zeros(weight.shape[0]) if bias is None else bias
        return out.copy_(swiglu_tail(y.expand(m, -1).to(x.dtype), gated))
    cfg = config or choose(m, weight.shape[0], k, x.dtype, x.device, gated)
    cfg = cfg or default_config(m, n, k, gated)
    bm = block_m(m)
    steps = triton.cdiv(k, cfg.block_k)
    per = triton.cdiv(steps, cfg.split_k)
    split = triton.cdiv(steps, per)  # no split without work
    tiles = triton.cdiv(n, cfg.block_n)
    ws = cnt = out  # dummies at split 1
    if split > 1:
        accs = 2 if gated else 1
        ws, cnt = _WORKSPACE.get(x.device, tiles * split * accs * cfg.block_n * bm, tiles)
    chained = pdl(x.device)
    launchable(_skinny_gemm_kernel)[(tiles, split)](
        x, weight, bias if bias is not None else x, out, ws, cnt, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), per * cfg.block_k, split,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, SPLIT=split > 1, GATED=gated,
        ROUND=out.dtype != x.dtype, UPCAST=interpreting(), BLOCK_M=bm, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PDL=chained, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=chained,
    )  # fmt: skip
    return out
