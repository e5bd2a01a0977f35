"""Variable-length causal prefill attention whose keys and values come from the paged cache.

A flattened batch (see `models/attention/metadata.py`): sequence i owns query rows
query_start_loc[i] .. query_start_loc[i + 1] - 1, which are the LAST query_len tokens of its
context of seq_len tokens. All seq_len keys/values (the cached prefix from earlier chunks or a
prefix-cache hit, plus this step's tokens) are already in the cache:

    context   |<------------ ctx = seq_len - query_len ------------>|<--- query_len --->|
    queries                                                         | q0 q1 ...         |
    query row r sits at position ctx + r and sees keys 0 .. ctx + r

One program computes a BLOCK_M tile of one sequence's queries for one head, flash-attention
style (online softmax over BLOCK_N key tiles, scores in base 2). Key tiles wholly left of the
tile's first query position need no mask and run in a first loop; the diagonal band runs in a
second, masked loop. Tiles are launched farthest-from-the-start first, so the long programs of
a causal batch start early and the short ones fill the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.paged_kv import attention_output, attention_strides, check_q_and_kv_cache
from llmfleet.kernels.triton_utils import interpreting, launchable

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,  # (num_tokens, num_heads, HEAD_DIM), unit stride in HEAD_DIM
    kv_ptr,  # (2, num_blocks, CACHE_BLOCK, num_kv_heads, HEAD_DIM), unit stride in HEAD_DIM
    block_tables_ptr,  # int32 (num_seqs, max_blocks_per_seq)
    query_start_loc_ptr,  # int32 (num_seqs + 1,)
    seq_lens_ptr,  # int32 (num_seqs,)
    out_ptr,  # (num_tokens, num_heads, HEAD_DIM), unit stride in HEAD_DIM
    qk_scale,  # softmax scale * log2(e)
    num_m_tiles,  # grid dim 2: cdiv(max_query_len, BLOCK_M)
    stride_q_tok,  # elements between tokens of q
    stride_q_head,  # elements between heads of q
    stride_o_tok,  # elements between tokens of out
    stride_o_head,  # elements between heads of out
    stride_c_kv,  # elements between the K and V halves of the cache
    stride_c_block,  # elements between cache blocks
    stride_c_off,  # elements between slots of one block
    stride_c_head,  # elements between kv heads of one slot
    stride_bt_seq,  # elements between rows of block_tables
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner iteration
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_tile = num_m_tiles - 1 - tl.program_id(2)  # the longest tiles first
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows within the sequence
    rmask = rows < q_len
    q_pos = ctx + rows  # their positions in the context
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
        mask=rmask[:, None],
        other=0.0,
    )  # (BLOCK_M, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_head_ptr = kv_ptr + (head // GROUP) * stride_c_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # Keys [0, full_end) precede every query of the tile: no mask.
    full_end = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(table_ptr + n // CACHE_BLOCK).to(tl.int64)
        k_ptrs = kv_head_ptr + (block * stride_c_block + (n % CACHE_BLOCK) * stride_c_off)[:, None]
        k_ptrs = k_ptrs + d[None, :]  # (BLOCK_N, HEAD_DIM)
        k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(k_ptrs + stride_c_kv)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # The diagonal band: key n is visible to row r when n <= q_pos[r] (and n < seq_len).
    band_end = tl.minimum(ctx + m0 + BLOCK_M, seq_len)
    for n0 in range(full_end, band_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < seq_len
        block = tl.load(table_ptr + n // CACHE_BLOCK, mask=nmask, other=0).to(tl.int64)
        k_ptrs = kv_head_ptr + (block * stride_c_block + (n % CACHE_BLOCK) * stride_c_off)[:, None]
        k_ptrs = k_ptrs + d[None, :]
        k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(k_ptrs + stride_c_kv, mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_prefill_config() -> PrefillConfig:
    if interpreting():
        return PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    return PrefillConfig()


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    check_q_and_kv_cache(q, kv_cache)
    num_seqs = seq_lens.shape[0]
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be int32 (num_seqs,), got {seq_lens.dtype}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be int32 ({num_seqs + 1},)")
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 ({num_seqs}, max_blocks)")


def paged_attention_prefill(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc: torch.Tensor,  # int32 (num_seqs + 1,)
    seq_lens: torch.Tensor,  # int32 (num_seqs,)
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    scale: float,
    max_query_len: int,  # host-side max query length: sizes the grid without a device sync
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, head_dim)
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Triton causal varlen attention over the paged cache; returns (num_tokens, heads, dim)."""
    _check(q, kv_cache, query_start_loc, seq_lens, block_tables)
    out = attention_output(q, kv_cache, block_tables, out)
    num_tokens, num_heads, head_dim = q.shape
    _, _, cache_block, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    cfg = config or default_prefill_config()
    num_m_tiles = triton.cdiv(max_query_len, cfg.block_m)
    launchable(_prefill_kernel)[(num_heads, num_seqs, num_m_tiles)](
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        num_m_tiles,
        *attention_strides(q, out, kv_cache, block_tables),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        CACHE_BLOCK=cache_block,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def paged_attention_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """PyTorch reference of `paged_attention_prefill`: per sequence, gather the context from
    the cache and run masked softmax(q k^T * scale) v in fp32 (`config` is ignored)."""
    _check(q, kv_cache, query_start_loc, seq_lens, block_tables)
    num_heads = q.shape[1]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    result = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, n in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        pos = torch.arange(n, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        k = kv_cache[0, blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        v = kv_cache[1, blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (q1 - q0), n, device=q.device)
        s = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), k) * scale
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        result[q0:q1] = torch.einsum("hmn,nhd->mhd", s.softmax(dim=-1), v).to(q.dtype)
    return result
