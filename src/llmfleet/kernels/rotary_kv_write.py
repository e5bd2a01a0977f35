"""Rotary embedding of q and k, then the rotated k and v scattered into the paged KV cache:
`rotary_embedding` followed by `kv_cache_write` (kernels/rotary.py, kernels/kv_cache_write.py)
in one launch, with the same results bit for bit.

    q: (num_tokens, num_q_heads, head_dim)    rotated in place
    k: (num_tokens, num_kv_heads, head_dim)   rotated in place, then written to the cache
    v: (num_tokens, num_kv_heads, head_dim)   written to the cache
    cos_sin_cache: (max_position, rot_dim) = [cos (rot_dim/2) | sin (rot_dim/2)] per position
    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)     0 = K, 1 = V
    slot s  ->  block s // block_size, offset s % block_size

Token j goes to slot `slot_mapping[j]`; a negative slot (padding) skips the cache write, but q
and k of that token are still rotated. Dimensions from rot_dim to head_dim (partial rotary)
are left as they are in q and k and copied unrotated into the cache.

`write_new_tokens` is the same write from inside the decode attention kernel (its ROPE flavour,
kernels/paged_attention_decode.py): one KV head's new tokens within one partition, rotated in
registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmfleet.kernels.kv_cache_write import check_kv_write_args, kv_cache_write_ref
from llmfleet.kernels.paged_kv import kv_write_strides
from llmfleet.kernels.rotary import (
    check_rotary_args,
    cos_sin_at,
    load_cos_sin,
    load_rotated,
    rotary_embedding_ref,
    rotate_heads,
)
from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr,  # int64 (num_tokens,)
    q_ptr,  # (num_tokens, num_q_heads, head_dim), unit stride in head_dim; updated in place
    k_ptr,  # (num_tokens, num_kv_heads, head_dim), unit stride in head_dim; updated in place
    v_ptr,  # same shape as k; may have different strides (q, k, v are often views of qkv)
    cos_sin_ptr,  # (max_position, 2 * HALF) contiguous: [cos | sin]
    cache_ptr,  # (2, num_blocks, block_size, num_kv_heads, head_dim), unit stride in head_dim
    slot_ptr,  # int64 (num_tokens,), < 0 = no cache write
    stride_q_tok,  # elements between tokens of q
    stride_q_head,  # elements between heads of q
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,  # elements between the K and the V halves of the cache
    stride_c_block,  # elements between consecutive cache blocks
    stride_c_off,  # elements between consecutive slots of one block
    stride_c_head,  # elements between consecutive kv heads of one slot
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rot_dim // 2
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_HQ: tl.constexpr,  # next power of two >= NUM_Q_HEADS
    BLOCK_HK: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_R: tl.constexpr,  # next power of two >= HALF
    BLOCK_REST: tl.constexpr,  # next power of two >= HEAD_DIM - 2 * HALF (unused if 0)
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    # One program per token: rotates its q and k heads, then copies k and v into the cache.
    # The rotation is rotary.py's, the cache write kv_cache_write.py's, on the rotated k as
    # stored (rounded to k's dtype), so the results are those of the two kernels in turn.
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok)
    cos, sin, r, rmask = load_cos_sin(cos_sin_ptr, pos, HALF, BLOCK_R)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q1_ptrs = q_ptr + tok * stride_q_tok + hq * stride_q_head + r
    rotate_heads(q1_ptrs, (hq < NUM_Q_HEADS) & rmask, cos, sin, HALF)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    kmask = (hk < NUM_KV_HEADS) & rmask
    k_row = k_ptr + tok * stride_k_tok + hk * stride_k_head  # (BLOCK_HK, 1)
    k1r, k2r = rotate_heads(k_row + r, kmask, cos, sin, HALF)

    if slot >= 0:
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = cache_ptr + block * stride_c_block + off * stride_c_off + hk * stride_c_head
        tl.store(dst + r, k1r.to(cache_ptr.dtype.element_ty), mask=kmask)
        tl.store(dst + HALF + r, k2r.to(cache_ptr.dtype.element_ty), mask=kmask)
        if BLOCK_REST > 0:  # partial rotary: k's unrotated tail goes to the cache as it is
            e = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
            emask = (hk < NUM_KV_HEADS) & (e < HEAD_DIM)
            rest = tl.load(k_row + e, mask=emask)
            tl.store(dst + e, rest.to(cache_ptr.dtype.element_ty), mask=emask)
        d = tl.arange(0, BLOCK_D)[None, :]
        vmask = (hk < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(v_ptr + tok * stride_v_tok + hk * stride_v_head + d, mask=vmask)
        tl.store(dst + stride_c_kv + d, v.to(cache_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def write_new_tokens(
    k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, kv_ptr, table_ptr, row, kv_head, seq_len,
    start, end, stride_k_seq, stride_k_head, stride_v_seq, stride_v_head, stride_c_kv,
    stride_c_block, stride_c_off, stride_c_head,
    HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Store, for one KV head, the rotated key and the value of every token this launch adds
    at a position in [start, end) of row `row`'s context (table_ptr: its block table row):
    the row's own token (position seq_len - 1) and those of the rows just before it that
    continue the same sequence (a sequence's drafts as rows), recognised by their slots.
    Returns how many tokens it stored."""
    d = tl.arange(0, HEAD_DIM)
    tok = seq_len - 1
    slot = tl.load(slot_ptr + row)
    stored = 0
    while (tok >= start) & (slot >= 0):
        if tok < end:
            stored += 1
            row64 = row.to(tl.int64)
            k_ptrs = k_ptr + row64 * stride_k_seq + kv_head * stride_k_head + d
            cos, sin = cos_sin_at(cos_sin_ptr, tl.load(pos_ptr + row), d, HALF)
            k = load_rotated(k_ptrs, d, d < HEAD_DIM, cos, sin, HALF, HEAD_DIM)
            v = tl.load(v_ptr + row64 * stride_v_seq + kv_head * stride_v_head + d)
            dst = (
                kv_ptr
                + (slot // CACHE_BLOCK) * stride_c_block
                + (slot % CACHE_BLOCK) * stride_c_off
                + kv_head * stride_c_head
                + d
            )
            tl.store(dst, k.to(kv_ptr.dtype.element_ty))
            tl.store(dst + stride_c_kv, v.to(kv_ptr.dtype.element_ty))
        row -= 1
        tok -= 1
        more = (row >= 0) & (tok >= start)
        prev = tl.load(slot_ptr + row, mask=more, other=-1)
        block = tl.load(table_ptr + tok // CACHE_BLOCK, mask=more, other=0).to(tl.int64)
        slot = tl.where(more & (prev == block * CACHE_BLOCK + tok % CACHE_BLOCK), prev, -1)
    return stored


def rotary_kv_cache_write(
    positions: torch.Tensor,  # int (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_q_heads, head_dim), rotated in place
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), rotated in place
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), in place
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), < 0 = skip the cache write
) -> None:
    """Triton: rotate q and k in place, write the rotated k and v into the cache at their slots."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    check_kv_write_args(k, v, kv_cache, slot_mapping)
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    cache = cos_sin_cache.contiguous()
    positions = positions.to(torch.int64)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    half = cache.shape[1] // 2
    rest = head_dim - 2 * half
    chained = pdl(q.device)
    launchable(_rotary_kv_write_kernel)[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cache,
        kv_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        *kv_write_strides(k, v, kv_cache),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_SIZE=block_size,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=chained,
        num_warps=4,
        launch_pdl=chained,
    )


def rotary_kv_cache_write_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """PyTorch reference of `rotary_kv_cache_write` (same arguments, same in-place effect);
    each of the two references checks its own arguments, before anything is written."""
    check_kv_write_args(k, v, kv_cache, slot_mapping)
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    kv_cache_write_ref(k, v, kv_cache, slot_mapping)
