"""Launcher checks and stride arguments shared by the kernels over the paged KV cache.

Cache layout (see `models/attention/metadata.py`), one tensor per layer:

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)     0 = K, 1 = V
    slot s  ->  block s // block_size, offset s % block_size

The kernels index head_dim with unit stride and take every other stride as an argument, in
the order `cache_strides` returns them.
"""

from __future__ import annotations

import torch

from llmfleet.kernels.triton_utils import check_last_dim_contiguous


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate a paged cache; returns (block_size, num_kv_heads, head_dim)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be (2, blocks, block_size, heads, dim), got {kv_cache.shape}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return block_size, num_kv_heads, head_dim


def check_q_and_kv_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate q (rows, k * num_kv_heads, head_dim) against a paged cache; returns
    (block_size, num_kv_heads, head_dim)."""
    block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be (rows, k * {num_kv_heads}, {head_dim}), got {q.shape}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    return block_size, num_kv_heads, head_dim


def attention_output(
    q: torch.Tensor,  # (rows, num_heads, head_dim)
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    out: torch.Tensor | None,  # (rows, num_heads, head_dim) or None
) -> torch.Tensor:
    """What the attention kernels need beyond their arguments' shapes (unit last strides;
    head_dim a power of two >= 16, for tl.arange and tl.dot), checked; returns `out`, or a new
    tensor like q when it is None."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    head_dim = q.shape[2]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit last stride")
    return out


def cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Elements between the K and V halves, between blocks, between the slots of a block and
    between the kv heads of a slot: the kernels' stride_c_kv, _block, _off, _head."""
    s_kv, s_block, s_off, s_head, _ = kv_cache.stride()
    return s_kv, s_block, s_off, s_head


def attention_strides(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The attention kernels' stride arguments, in their order: rows and heads of q, rows and
    heads of out, `cache_strides`, rows of block_tables."""
    return (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides(kv_cache),
        block_tables.stride(0),
    )


def kv_write_strides(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, ...]:
    """The cache writers' stride arguments for k, v and the cache, in their order: tokens and
    heads of k, tokens and heads of v, `cache_strides`."""
    return (k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides(kv_cache))
