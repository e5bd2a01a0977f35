"""Rotary position embedding, neox style (rotate halves), applied in place to q and k.

For each head vector x and its token's position p, with r = rot_dim / 2 and d < r:

    x[d]     <- x[d] * cos[p, d] - x[d + r] * sin[p, d]
    x[d + r] <- x[d + r] * cos[p, d] + x[d] * sin[p, d]

Dimensions from rot_dim to head_dim (partial rotary) are left untouched.

    cos_sin_cache: (max_position, rot_dim) = [cos (r) | sin (r)] per position

Frequency scaling (Llama 3's long-context rule) changes only the cache, built by
`build_cos_sin_cache`; the kernel is the same for every model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start


@triton.jit
def load_cos_sin(cache_ptr, pos, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """cos and sin at position `pos`, each (1, BLOCK_R) float32, with their column offsets
    r and the mask r < HALF."""
    r = tl.arange(0, BLOCK_R)[None, :]
    rmask = r < HALF
    cos = tl.load(cache_ptr + pos * (2 * HALF) + r, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + r, mask=rmask, other=0.0).to(tl.float32)
    return cos, sin, r, rmask


@triton.jit
def rotate_heads(x1_ptrs, mask, cos, sin, HALF: tl.constexpr):
    """Rotate in place the head halves at x1_ptrs and x1_ptrs + HALF, in float32; returns
    the two rotated halves as stored (rounded to the tensor's dtype)."""
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # Explicit FMAs (x cos + (-/+ partner sin)): a compiler would contract the products its own
    # way in each kernel; this way every kernel that rotates (`load_rotated`) rounds alike.
    o1 = tl.fma(x1, cos, -(x2 * sin)).to(x1_ptrs.dtype.element_ty)
    o2 = tl.fma(x2, cos, x1 * sin).to(x1_ptrs.dtype.element_ty)
    tl.store(x1_ptrs, o1, mask=mask)
    tl.store(x1_ptrs + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def cos_sin_at(cos_sin_ptr, pos, d, HALF: tl.constexpr):
    """cos and sin (float32, shaped like d) at position `pos` for head columns d: those of
    pair d % HALF, zero from column 2 * HALF on."""
    rot = d < 2 * HALF
    ptrs = cos_sin_ptr + pos * (2 * HALF) + tl.where(d < HALF, d, d - HALF)
    cos = tl.load(ptrs, mask=rot, other=0.0).to(tl.float32)
    sin = tl.load(ptrs + HALF, mask=rot, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def load_rotated(x_ptrs, d, mask, cos, sin, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Whole head vectors loaded from x_ptrs (columns d, 0 <= d < HEAD_DIM) and returned
    rotated with `cos_sin_at`'s cos and sin, with the values `rotate_heads` would store
    (nothing is stored): column d is computed from its partner column (d + HALF for d < HALF,
    d - HALF for HALF <= d < 2 * HALF), in float32, then rounded to x's dtype. Columns from
    2 * HALF on (partial rotary) come back as loaded."""
    lo = d < HALF
    rot = d < 2 * HALF
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    partner = x_ptrs + tl.where(lo, HALF, -HALF)
    y = tl.load(partner, mask=mask & rot, other=0.0).to(tl.float32)
    ys = y * sin
    out = tl.fma(x.to(tl.float32), cos, tl.where(lo, -ys, ys)).to(x_ptrs.dtype.element_ty)
    if 2 * HALF < HEAD_DIM:
        out = tl.where(rot, out, x)
    return out


@triton.jit
def _rotary_kernel(
    pos_ptr,  # int64 (num_tokens,)
    q_ptr,  # (num_tokens, num_q_heads, head_dim), unit stride in head_dim; updated in place
    k_ptr,  # (num_tokens, num_kv_heads, head_dim), unit stride in head_dim; updated in place
    cache_ptr,  # (max_position, ROT_DIM) contiguous: [cos | sin]
    stride_q_tok,  # elements between tokens of q
    stride_q_head,  # elements between heads of q
    stride_k_tok,
    stride_k_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # rot_dim // 2
    BLOCK_HQ: tl.constexpr,  # next power of two >= NUM_Q_HEADS
    BLOCK_HK: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_R: tl.constexpr,  # next power of two >= HALF
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    cos, sin, r, rmask = load_cos_sin(cache_ptr, pos, HALF, BLOCK_R)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q1_ptrs = q_ptr + tok * stride_q_tok + hq * stride_q_head + r
    rotate_heads(q1_ptrs, (hq < NUM_Q_HEADS) & rmask, cos, sin, HALF)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    k1_ptrs = k_ptr + tok * stride_k_tok + hk * stride_k_head + r
    rotate_heads(k1_ptrs, (hk < NUM_KV_HEADS) & rmask, cos, sin, HALF)


def check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k must be (tokens, heads, head_dim), got {q.shape}, {k.shape}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int ({q.shape[0]},), got {positions.shape}")
    rot_dim = cache.shape[-1] if cache.dim() == 2 else -1
    if rot_dim < 2 or rot_dim % 2 or rot_dim > q.shape[2]:
        raise ValueError(
            f"cos_sin_cache must be (max_position, rot_dim <= head_dim), got {cache.shape}"
        )


def rotary_embedding(
    positions: torch.Tensor,  # int (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_q_heads, head_dim), rotated in place
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), rotated in place
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
) -> None:
    """Triton neox-style rotary embedding, in place on q and k."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    for name, t in (("q", q), ("k", k)):
        check_last_dim_contiguous(name, t)
    cache = cos_sin_cache.contiguous()
    positions = positions.to(torch.int64)
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    half = cache.shape[1] // 2
    if num_tokens == 0:
        return
    chained = pdl(q.device)
    launchable(_rotary_kernel)[(num_tokens,)](
        positions,
        q,
        k,
        cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(half),
        PDL=chained,
        num_warps=4,
        launch_pdl=chained,
    )


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """PyTorch reference of `rotary_embedding` (same arguments, same in-place effect)."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.float()[positions.long()]  # (T, rot_dim)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1 = t[..., :half].float()  # a view when t is fp32: compute both halves first
        x2 = t[..., half : 2 * half].float()
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half : 2 * half] = o2.to(t.dtype)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's `rope_scaling` (`rope_type: llama3`): long wavelengths are slowed by
    `factor`, short ones kept, the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope scaling {self}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, mid)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def build_cos_sin_cache(
    rot_dim: int,
    max_position: int,
    base: float = 10000.0,
    scaling: Llama3RopeScaling | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(max_position, rot_dim) = [cos | sin] of position * inv_freq, computed in float64."""
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return cache.to(dtype=dtype, device=device)
