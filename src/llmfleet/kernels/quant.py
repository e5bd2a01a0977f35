"""Activation quantization to FP8 (e4m3) and INT8: dynamic per-token and static per-tensor.

Layout: `x` is (M, K) with unit stride along K (rows may be strided, e.g. a slice of a larger
buffer). Outputs are a contiguous (M, K) tensor `q` and float32 scales such that
`x ~= q.float() * scale`:

    dynamic per-token:  scale (M, 1) = max(|x[m, :]|, EPS) / QMAX
    static per-tensor:  scale (1,) given by the caller (calibrated offline)

INT8 rounds half away from zero; FP8 uses the hardware round-to-nearest-even conversion. Both
saturate to +-QMAX (448 for e4m3fn, 127 for int8), so no value maps to NaN or wraps.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
INT8_MAX = 127.0
# Smallest absmax used for a scale: an all-zero row gets a tiny positive scale, not 0 / 0.
SCALE_EPS = 1e-10

_QMAX = {FP8_DTYPE: FP8_MAX, torch.int8: INT8_MAX}


@triton.jit
def _round_and_cast(y, IS_INT8: tl.constexpr, QMAX: tl.constexpr, FP8_PRE_ROUND: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:
        # Round half away from zero (no rint in the interpreter; the reference matches this).
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    elif FP8_PRE_ROUND:
        # Interpreter only: its float32 -> e4m3 cast drops the carry when rounding up crosses a
        # power of two (31.4 -> 16). Round to the e4m3 grid here (nearest, ties to even; 3
        # mantissa bits, subnormal step 2**-9) so the cast is exact. GPUs convert in hardware.
        a = tl.abs(y)
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
        e = tl.where(a < tl.exp2(e), e - 1.0, e)
        e = tl.maximum(tl.where(a >= tl.exp2(e + 1.0), e + 1.0, e), -6.0)
        step = tl.exp2(e - 3.0)
        v = a / step
        r = tl.floor(v + 0.5)
        r = tl.where((r - v == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
        y = tl.where(y < 0, -r * step, r * step)
    return y


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,  # elements between rows of x; x is unit-stride along K
    stride_qm,  # elements between rows of q (== K, q is contiguous)
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    EPS: tl.constexpr,
    FP8_PRE_ROUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    # One program per row: pass 1 finds the row's absmax, pass 2 scales, rounds and stores.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if SINGLE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
        scale = absmax / QMAX
        y = _round_and_cast(x * (QMAX / absmax), IS_INT8, QMAX, FP8_PRE_ROUND)
        tl.store(q_row + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        absmax = tl.maximum(tl.max(acc, axis=0), EPS)
        scale = absmax / QMAX
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            y = _round_and_cast(x * (QMAX / absmax), IS_INT8, QMAX, FP8_PRE_ROUND)
            tl.store(q_row + k0 + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _static_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,  # (1,) float32 per-tensor scale
    K,
    stride_xm,  # elements between rows of x; x is unit-stride along K
    stride_qm,  # elements between rows of q (== K)
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    FP8_PRE_ROUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid (M, cdiv(K, BLOCK_K)): each program quantizes one BLOCK_K slice of one row.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    inv_scale = 1.0 / tl.load(scale_ptr)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_and_cast(x * inv_scale, IS_INT8, QMAX, FP8_PRE_ROUND)
    tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_input(x: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in _QMAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x must be unit-stride along K")


def per_token_quant(
    x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: x (M, K) -> q (M, K) `dtype`, scale (M, 1) float32."""
    _check_input(x, dtype)
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(triton.next_power_of_2(max(k, 1)), 8192)
    _per_token_quant_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        IS_INT8=dtype == torch.int8,
        QMAX=_QMAX[dtype],
        EPS=SCALE_EPS,
        FP8_PRE_ROUND=_interpreting(),
        BLOCK_K=block_k,
        SINGLE_PASS=block_k >= k,
        num_warps=8 if block_k >= 4096 else 4,
    )
    return q, scale


def static_quant(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> torch.Tensor:
    """Static per-tensor quantization with a given float32 scale of one element."""
    _check_input(x, dtype)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError("scale must be a float32 tensor with one element")
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    if m == 0:
        return q
    block_k = min(triton.next_power_of_2(max(k, 1)), 1024)
    _static_quant_kernel[(m, triton.cdiv(k, block_k))](
        x,
        q,
        scale.reshape(1),
        k,
        x.stride(0),
        q.stride(0),
        IS_INT8=dtype == torch.int8,
        QMAX=_QMAX[dtype],
        FP8_PRE_ROUND=_interpreting(),
        BLOCK_K=block_k,
    )
    return q


def _round_cast_ref(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    qmax = _QMAX[dtype]
    y = y.clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))
    return y.to(dtype)


def per_token_quant_ref(
    x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `per_token_quant`."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1, keepdim=True).clamp_min(SCALE_EPS)
    qmax = _QMAX[dtype]
    return _round_cast_ref(xf * (qmax / absmax), dtype), absmax / qmax


def static_quant_ref(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> torch.Tensor:
    """PyTorch reference of `static_quant`."""
    return _round_cast_ref(x.float() * (1.0 / scale.float().reshape(())), dtype)
