"""SwiGLU activation of a fused gate/up projection.

    x: (num_tokens, 2 * I) = [gate | up]   ->   out: (num_tokens, I) = silu(gate) * up

Computed in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up of float32 tensors: the SwiGLU activation, computed alike by this
    kernel and by the GEMMs that fuse it into their epilogue."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def silu_mul_rounded(gate, up, DTYPE: tl.constexpr):
    """`silu_mul` of float32 sums first rounded to DTYPE: a fused [gate | up] projection's
    epilogue giving what the projection's 16-bit output through this kernel would."""
    return silu_mul(gate.to(DTYPE).to(tl.float32), up.to(DTYPE).to(tl.float32))


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (num_tokens, 2 * INTER), unit stride in the last dim
    out_ptr,  # (num_tokens, INTER), contiguous
    stride_x,  # elements between rows of x
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,  # columns of out per program
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(gate, up)
    tl.store(out_ptr + row * INTER + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be (tokens, 2 * intermediate), got {tuple(x.shape)}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton silu(x[:, :I]) * x[:, I:] for x (num_tokens, 2I); returns (num_tokens, I)."""
    _check(x)
    check_last_dim_contiguous("x", x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens > 0 and inter > 0:
        block = min(triton.next_power_of_2(inter), 1024)
        grid = (num_tokens, triton.cdiv(inter, block))
        chained = pdl(x.device)
        launchable(_silu_and_mul_kernel)[grid](
            x, out, x.stride(0), INTER=inter, BLOCK=block, PDL=chained, num_warps=4,
            launch_pdl=chained,
        )  # fmt: skip
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `silu_and_mul`."""
    _check(x)
    inter = x.shape[1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]).to(x.dtype)
