"""Matrix-vector product of a 16-bit linear layer for one token (decode at batch 1).

    x (1, K) · W (N, K)ᵀ [+ bias (N,)]  ->  out (1, N)

At M = 1 a linear layer is a stream over its weight: N K 16-bit values read once, two FLOPs
each. cuBLAS serves some of Llama's shapes (the square o projection, q/k/v) at well under the
bandwidth it reaches on others. This kernel gives every program BLOCK_N whole rows of W,
streams them along K in BLOCK_K-wide tiles (16-byte loads, marked evict-first: each weight is
used once), and multiplies in float32 into a (BLOCK_N, BLOCK_K) accumulator that is reduced
once at the end, so the loop is loads and FMAs only. No split-K: a row's sum stays in one
program, so there is no workspace or atomic, and the result is deterministic.

Launched under PDL (triton_utils.pdl_start), a program whose weight is a model parameter (an
`nn.Parameter`: no kernel of the step writes it) reads its first weight tile before it waits on
the kernel before it, so the weight stream begins while that kernel finishes; x is read only
after the wait.

Two epilogue options save a kernel each in a decode step:
  - gated: W is a fused [gate | up] (2I, K) projection and the result is the SwiGLU
    silu(x · gateᵀ) * (x · upᵀ), (1, I). Each program streams BLOCK_N rows of both halves;
    both sums are rounded to x's dtype before the activation, as the unfused
    linear + `silu_and_mul` pair computes it. The model runs it where this device's tuned
    file (`TUNED_SILU`) says it beat the pair.
  - a float32 `out` for 16-bit x (the output head writing straight into the sampler's
    float32 logits): the sums are rounded to x's dtype first, so the values equal
    `F.linear(x, W).float()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmfleet.kernels.all_reduce import (
    EMPTY,
    MAX_ROWS,
    ROW_BYTES,
    PeerState,
    next_call,
    push_slice,
)
from llmfleet.kernels.silu_and_mul import silu_mul_rounded
from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl
from llmfleet.kernels.tuned_configs import TunedConfigs


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows of W per program
    block_k: int  # columns per loop step
    num_warps: int = 4
    num_stages: int = 1


@triton.jit
def _weight_tile(ptrs, k0, K, offs_k, EVEN_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) tile of W at column k0 (zeros past K)."""
    if EVEN_K:
        return tl.load(ptrs, eviction_policy="evict_first")
    k_ok = k0 + offs_k < K
    return tl.load(ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _x_tile(x_ptr, k0, K, offs_k, EVEN_K: tl.constexpr):
    """x[k0 : k0 + BLOCK_K] in float32 (zeros past K)."""
    if EVEN_K:
        return tl.load(x_ptr + k0 + offs_k).to(tl.float32)
    return tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,  # (K,), unit stride
    w_ptr,  # (N, K), or (2N, K) = [gate | up] when GATED; unit stride along K
    bias_ptr,  # (N,) or (2N,) when GATED, or a dummy when not HAS_BIAS
    out_ptr,  # (N,)
    N,  # output columns
    K,
    stride_wn,  # elements between rows of W
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the loop
    GATED: tl.constexpr,  # out = silu(x . gate^T) * (x . up^T)
    ROUND: tl.constexpr,  # out is wider than x: round the result to x's dtype first
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    EARLY: tl.constexpr,  # W is not written in this kernel chain: read its first tile early
    data_ptrs=None,  # PUSH: int64 (WORLD,), every rank's all-reduce buffer (kernels/all_reduce)
    seq_ptr=None,  # PUSH: int32, that all-reduce's call numbers per row
    PUSH: tl.constexpr = False,  # also send the result to the peers (all_reduce.push_slice)
    RANK: tl.constexpr = 0,
    WORLD: tl.constexpr = 1,
    ROW_ELEMS: tl.constexpr = 0,
    MAX_ROWS: tl.constexpr = 0,
    EMPTY: tl.constexpr = 0,
    STANDIN: tl.constexpr = 0,
):
    # Under PDL the program starts while the kernel before it still runs (see pdl_start).
    # A weight no kernel of the chain writes (a model parameter) is read before the wait: its
    # first tile streams in while the previous kernel finishes (an all-reduce waiting on its
    # peers, an attention kernel), so that time is not lost to the weight stream.
    if PDL:
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # clamped: the loads need no row mask
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = w_ptr + (rows + N)[:, None] * stride_wn + offs_k[None, :]  # GATED: up rows
    w = _weight_tile(w_ptrs, 0, K, offs_k, EVEN_K)
    u = w
    if GATED:
        u = _weight_tile(up_ptrs, 0, K, offs_k, EVEN_K)
    if PDL:
        if EARLY:
            gdc_wait()
    if PUSH:
        call = next_call(seq_ptr)
    xk = _x_tile(x_ptr, 0, K, offs_k, EVEN_K)
    acc = w.to(tl.float32) * xk[None, :]
    acc_up = u.to(tl.float32) * xk[None, :]  # (unused unless GATED)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        xk = _x_tile(x_ptr, k0, K, offs_k, EVEN_K)
        acc += _weight_tile(w_ptrs, k0, K, offs_k, EVEN_K).to(tl.float32) * xk[None, :]
        if GATED:
            up_ptrs += BLOCK_K
            acc_up += _weight_tile(up_ptrs, k0, K, offs_k, EVEN_K).to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    if GATED:
        y_up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            y_up += tl.load(bias_ptr + N + rows).to(tl.float32)
        y = silu_mul_rounded(y, y_up, x_ptr.dtype.element_ty)
    if ROUND:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, y, mask=n_ok)
    if PUSH:
        push_slice(
            y, offs_n, n_ok, data_ptrs, call, RANK, WORLD, ROW_ELEMS, MAX_ROWS, EMPTY, STANDIN
        )


def default_gemv_config(n: int, k: int) -> GemvConfig:
    """Untuned choice, close to the fastest candidate on every Llama-3-8B projection shape of
    `bench_gemv` (the fastest differs by shape and by device, hence the tuned files)."""
    return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=1)


TUNED = TunedConfigs("gemv", GemvConfig)  # keys (N, K); `bench_gemv --save` writes them
# The gated variant's (`bench_gemv --gated --save`), keyed by the fused [gate | up] weight's
# (2I, K); block_n counts rows per half; null where the projection and then `silu_and_mul`
# were as fast.
TUNED_SILU = TunedConfigs("gemv_silu", GemvConfig)


def get_config(
    n: int, k: int, dtype: torch.dtype, device: torch.device, gated: bool = False
) -> GemvConfig:
    """The tuned config of this shape (W's rows, K) on this device, else the untuned default
    (gated: half its rows from each half of W)."""
    if gated:
        return TUNED_SILU.get(device, dtype, (n, k), None) or GemvConfig(4, 512, 4, 1)
    return TUNED.get(device, dtype, (n, k), None) or default_gemv_config(n, k)


def gated_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig | None:
    """The gated GEMV's tuned config for a (2I = n, K) weight on this device, or None where the
    unfused pair won or nothing was tuned (the caller then runs the projection, then
    `silu_and_mul`)."""
    return TUNED_SILU.get(device, dtype, (n, k), None)


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
) -> None:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be (1, K), got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (N, {x.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight must have 2 * I rows [gate | up], got {weight.shape[0]}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({weight.shape[0]},) {x.dtype}, got {tuple(bias.shape)}")


def out_columns(weight: torch.Tensor, gated: bool) -> int:
    """Columns of the result: W's rows, half of them when `gated`."""
    return weight.shape[0] // 2 if gated else weight.shape[0]


def check_out(out: torch.Tensor, x: torch.Tensor, n: int, gated: bool) -> None:
    """A caller's `out` for x's rows and n columns: x's dtype, or float32 (not gated)."""
    wide = out.dtype == torch.float32 and not gated
    if out.shape != (x.shape[0], n) or not (out.dtype == x.dtype or wide):
        raise ValueError(
            f"out must be ({x.shape[0]}, {n}) of x's dtype{'' if gated else ' or float32'}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    check_last_dim_contiguous("out", out)


def gemv(
    x: torch.Tensor,  # (1, K) fp16/bf16/fp32
    weight: torch.Tensor,  # (N, K), x's dtype, unit stride along K; (2I, K) [gate | up] if gated
    bias: torch.Tensor | None = None,  # (N,)
    config: GemvConfig | None = None,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,  # (1, N or I), x's dtype or (not gated) float32
    push: PeerState | None = None,  # also send the result into these peers' all-reduce cells
) -> torch.Tensor:
    """Triton x @ weight.T (+ bias) for one row: `F.linear`'s function at M = 1. `gated`:
    silu(x @ gate.T) * (x @ up.T) instead, (1, I). A float32 `out` gets the values rounded to
    x's dtype first (module docstring). Gated, `config.block_n` counts the rows each program
    takes from each half. `push`: each program also writes its slice of the result into the
    peers' cells of that group's next all-reduce call (module docstring; not gated, 16-bit
    out, N within a row of the all-reduce)."""
    _check(x, weight, bias, gated)
    check_last_dim_contiguous("weight", weight)
    k = weight.shape[1]
    n = out_columns(weight, gated)
    x = x.contiguous()
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    check_out(out, x, n, gated)
    if push is not None and (gated or out.element_size() != 2 or n * 2 > ROW_BYTES or k == 0):
        raise ValueError("a pushed GEMV is not gated, has K > 0 and a 16-bit row <= ROW_BYTES")
    if n == 0:
        return out
    if k == 0:
        y = weight.new_zeros(weight.shape[0]) if bias is None else bias
        return out.copy_(swiglu_tail(y[None, :].to(x.dtype), gated))
    cfg = config or get_config(weight.shape[0], k, x.dtype, x.device, gated)
    grid = (triton.cdiv(n, cfg.block_n),)
    chained = pdl(x.device)
    pushing = {}
    if push is not None:
        empty, standin = EMPTY[2]
        pushing = dict(
            data_ptrs=push.data_ptrs, seq_ptr=push.seq, PUSH=True, RANK=push.rank,
            WORLD=push.world, ROW_ELEMS=ROW_BYTES // 2, MAX_ROWS=MAX_ROWS, EMPTY=empty,
            STANDIN=standin,
        )  # fmt: skip
    launchable(_gemv_kernel)[grid](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, GATED=gated,
        ROUND=out.dtype != x.dtype, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=chained,
        EARLY=isinstance(weight, torch.nn.Parameter), **pushing,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=chained,
    )  # fmt: skip
    return out


def swiglu_tail(y: torch.Tensor, gated: bool) -> torch.Tensor:
    """The gated epilogue on a projection's output of x's dtype (the references' tail)."""
    if not gated:
        return y
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor:
    """PyTorch reference of `gemv`: float32 products and sums, rounded once to x's dtype
    (gated: then the SwiGLU in float32, rounded again)."""
    _check(x, weight, bias, gated)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return swiglu_tail(y.to(x.dtype), gated)
