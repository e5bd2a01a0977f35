"""Matrix-vector product of a 16-bit linear layer for one token (decode at batch 1).

    x (1, K) · W (N, K)ᵀ [+ bias (N,)]  ->  out (1, N)

At M = 1 a linear layer is a stream over its weight: N K 16-bit values read once, two FLOPs
each. cuBLAS serves some of Llama's shapes at well under the bandwidth it reaches on others
(on an H100: the 4096 x 4096 o projection at about 61% of copy bandwidth, q/k/v at 75%, while
gate/up reaches 94%). This kernel gives every program BLOCK_N whole rows of W, streams them
along K in BLOCK_K-wide tiles (16-byte loads, marked evict-first: each weight is used once),
and multiplies in float32 into a (BLOCK_N, BLOCK_K) accumulator that is reduced once at the
end, so the loop is loads and FMAs only. No split-K: a row's sum stays in one program, so
there is no workspace or atomic, and the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start
from llmfleet.kernels.tuned_configs import TunedConfigs


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows of W per program
    block_k: int  # columns per loop step
    num_warps: int = 4
    num_stages: int = 1


@triton.jit
def _gemv_kernel(
    x_ptr,  # (K,), unit stride
    w_ptr,  # (N, K), unit stride along K
    bias_ptr,  # (N,) or a dummy when not HAS_BIAS
    out_ptr,  # (N,)
    N,
    K,
    stride_wn,  # elements between rows of W
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the loop
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # clamped: the loads need no row mask
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            xk = tl.load(x_ptr + k0 + offs_k)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xk = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def default_gemv_config(n: int, k: int) -> GemvConfig:
    """Untuned choice. kernels/bench_gemv.py's sweep on an H100 over Llama-3-8B's projection
    shapes: within 2.5% of the fastest candidate on every shape (the fastest differs by shape
    and by device, hence the tuned files)."""
    return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=1)


TUNED = TunedConfigs("gemv", GemvConfig)  # keys (N, K); `bench_gemv --save` writes them


def get_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The tuned config of this shape on this device, else `default_gemv_config`."""
    return TUNED.get(device, dtype, (n, k), None) or default_gemv_config(n, k)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be (1, K), got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (N, {x.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({weight.shape[0]},) {x.dtype}, got {tuple(bias.shape)}")


def gemv(
    x: torch.Tensor,  # (1, K) fp16/bf16/fp32
    weight: torch.Tensor,  # (N, K), x's dtype, unit stride along K
    bias: torch.Tensor | None = None,  # (N,)
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Triton x @ weight.T (+ bias) for one row: `F.linear`'s function at M = 1."""
    _check(x, weight, bias)
    check_last_dim_contiguous("weight", weight)
    n, k = weight.shape
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias[None, :])
    cfg = config or get_config(n, k, x.dtype, x.device)
    grid = (triton.cdiv(n, cfg.block_n),)
    chained = pdl(x.device)
    launchable(_gemv_kernel)[grid](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=chained,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=chained,
    )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """PyTorch reference of `gemv`: float32 products and sums, rounded once to x's dtype."""
    _check(x, weight, bias)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
