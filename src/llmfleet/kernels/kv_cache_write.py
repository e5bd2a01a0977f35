"""Scatter this step's keys and values into the paged KV cache.

Cache layout (see `models/attention/metadata.py`), one tensor per layer:

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)     0 = K, 1 = V
    slot s  ->  block s // block_size, offset s % block_size

New token j goes to slot `slot_mapping[j]`; a negative slot marks a padding token (for example
a CUDA-graph batch padded to a captured size) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmfleet.kernels.paged_kv import check_kv_cache, kv_write_strides
from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start


@triton.jit
def _kv_cache_write_kernel(
    k_ptr,  # (num_tokens, num_kv_heads, head_dim), unit stride in head_dim
    v_ptr,  # same shape as k; may have different strides (k and v are often views of qkv)
    cache_ptr,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_ptr,  # int64 (num_tokens,)
    stride_k_tok,  # elements between consecutive tokens of k
    stride_k_head,  # elements between consecutive heads of k
    stride_v_tok,
    stride_v_head,
    stride_c_kv,  # elements between the K and the V halves of the cache
    stride_c_block,  # elements between consecutive cache blocks
    stride_c_off,  # elements between consecutive slots of one block
    stride_c_head,  # elements between consecutive kv heads of one slot
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    # One program per new token: copies all its kv heads, K and V.
    pdl_start(PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    tok64 = tok.to(tl.int64)
    k = tl.load(k_ptr + tok64 * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + tok64 * stride_v_tok + h * stride_v_head + d, mask=mask)
    dst = cache_ptr + block * stride_c_block + off * stride_c_off + h * stride_c_head + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def check_kv_write_args(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k/v must be (tokens, {num_kv_heads}, {head_dim}), got {k.shape}, {v.shape}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int64 ({k.shape[0]},), got {slot_mapping.dtype}")


def kv_cache_write(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), written in place
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), < 0 = skip
) -> None:
    """Write k and v of each new token into the cache at its slot (Triton)."""
    check_kv_write_args(k, v, kv_cache, slot_mapping)
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    chained = pdl(k.device)
    launchable(_kv_cache_write_kernel)[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        *kv_write_strides(k, v, kv_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=chained,
        num_warps=4,
        launch_pdl=chained,
    )


def kv_cache_write_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """PyTorch reference of `kv_cache_write` (same arguments, same in-place effect)."""
    check_kv_write_args(k, v, kv_cache, slot_mapping)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offs = slots // block_size, slots % block_size
    kv_cache[0, blocks, offs] = k[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offs] = v[keep].to(kv_cache.dtype)
