"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

    rms_norm(x, w)               -> x * rsqrt(mean(x^2) + eps) * w
    rms_norm(x, w, residual=r)   -> (rms_norm(x + r, w), x + r)

`x + r` is rounded to the model dtype first (it is the residual stream the next layer reads),
and the norm is taken of that rounded value, so the fused call equals the two unfused steps.
Statistics and the scaling are computed in fp32; the result is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (num_tokens, hidden), unit stride in hidden
    res_ptr,  # (num_tokens, hidden) residual, read only when HAS_RESIDUAL
    w_ptr,  # (hidden,)
    out_ptr,  # (num_tokens, hidden), contiguous
    new_res_ptr,  # (num_tokens, hidden), contiguous; written only when HAS_RESIDUAL
    stride_x,  # elements between rows of x
    stride_res,  # elements between rows of the residual
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HIDDEN: one row lives in registers
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * HIDDEN + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be (tokens, hidden) and weight (hidden,), got {x.shape}, {weight.shape}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {x.shape} {x.dtype}, got {residual.shape}")


def rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (num_tokens, hidden)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm. With `residual`: returns (normed, new_residual), inputs untouched."""
    _check(x, weight, residual)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if residual is not None:
        check_last_dim_contiguous("residual", residual)
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        chained = pdl(x.device)
        launchable(_rms_norm_kernel)[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_res,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            PDL=chained,
            num_warps=min(max(block // 256, 1), 16),
            launch_pdl=chained,
        )
    return (out, new_res) if residual is not None else out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `rms_norm` (same arguments, same results)."""
    _check(x, weight, residual)
    new_res = None
    if residual is not None:
        new_res = (
            (x.float() + residual.float()).to(x.dtype) if x.dtype != torch.float64 else x + residual
        )
        x = new_res
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * rstd * weight.to(xf.dtype)).to(x.dtype)
    return (out, new_res) if new_res is not None else out
