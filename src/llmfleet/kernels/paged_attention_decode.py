"""Decode attention over the paged KV cache: one new query token per sequence.

Cache layout (see `models/attention/metadata.py`):

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)     0 = K, 1 = V
    token t of seq i: block block_tables[i, t // block_size], offset t % block_size

Work split (split-K, GQA-aware). Program (seq, kv_head, part) reads the keys and values of
tokens [part * P, (part + 1) * P) of one KV head exactly once, and scores them against all
GROUP = num_heads // num_kv_heads query heads that share that KV head (the group is padded to
16 rows so the scores are one tensor-core product):

    seq_len = 9000, P = 4096:   part 0: [0, 4096)   part 1: [4096, 8192)   part 2: [8192, 9000)
                                    |                   |                      |
                          (m, l, acc) per head  (m, l, acc) per head   (m, l, acc) per head
                                    \\__________________|______________________/
                                           reduce: out = sum_p e^(m_p - M) acc_p
                                                         / sum_p e^(m_p - M) l_p

m is the running max of the scaled scores (base 2), l the running sum of exp2(s - m), acc the
unnormalised sum of exp2(s - m) * v. With a single partition the first kernel normalises and
writes the output directly and the reduction is not launched. With several, the program of
each (seq, KV head) that finishes last (an arrival counter per pair, `DecodeConfig.reduce_last`)
combines its heads' partitions itself, so a decode step's attention stays one kernel; the
counters live on the device, zeroed once and re-armed by that program. Only the programs of
partitions that hold tokens report, and a context that fits one partition (a short one in a
grid sized for the longest) is written out by its one program, without partials or counter.
The combination and the counters live in kernels/decode_partitions.py.

Partition size. The grid has `num_parts` partitions per sequence, fixed on the host from the
bound `max_seq_len` (inside a CUDA graph that is the static `max_model_len`). Each sequence
spreads its own length over them: P = max(min_partition, seq_len / num_parts rounded up to
BLOCK_N), so a short context in a grid sized for a long one still runs on several programs of
one tile each rather than on one program looping over its whole length. A fixed
`DecodeConfig.partition_size` sets min_partition = P with num_parts = cdiv(max_seq_len, P).

Rotary and cache write in the same launch (`paged_attention_decode_rope`, the ROPE flavour of
the kernel): q and the new tokens' k and v arrive unrotated and not yet cached (views of the
fused qkv activation). Every program rotates its group's query heads in registers, as
kernels/rotary.py does (float32, rounded to q's dtype). The new token of row i sits at
position seq_len - 1; the program whose partition holds it rotates that KV head's k, stores k
and v at the row's slot (none when the slot is < 0), and passes a barrier before its loop, so
its own loads see the stores (a program that stored nothing passes none):

    row i, seq_len = 9000, P = 4096:   part 0          part 1          part 2
                                       attend          attend          rotate k, store k, v
                                                                       at slot[i]; barrier;
                                                                       attend [8192, 9000)

No other program reads that slot, except when rows continue one sequence (its drafts as
decode rows: row i + 1 at position seq_len, over the same block table): then row i + 1's
programs read row i's token, and no launch order guarantees that row i's programs have
stored it. So a program also stores the tokens of the rows just before its own that continue
its sequence (recognised by their slots) and fall in its partition. Stores of one token by
several programs write the same bytes. q and k are left unrotated in memory.

Early loads under PDL. A decode step's attention is a chain of dependent loads (a row's
length, its block table, the first tile of keys and values; with ROPE the position and its
cos/sin) of which only q, k and v come from the kernel before it (their projection). A program
reads the rest before it waits on that kernel, while the projection finishes: the step's
metadata, copied in before the step's first kernel, and (ROPE) the first tile as the cache
holds it, written by earlier steps (their launches are ordered before this step's input copies,
which no kernel of the step may pass). The tokens this launch adds are the one exception: a
program that stores some reads them again, after its barrier, where the first tile holds them.
Without ROPE the kernel before wrote this step's tokens, so the tiles wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmfleet.kernels.decode_partitions import (
    arrival_counters,
    combine_partitions,
    decode_reduce_kernel,
    partition_size_of,
)
from llmfleet.kernels.kv_cache_write import check_kv_write_args
from llmfleet.kernels.paged_kv import attention_output, attention_strides, check_q_and_kv_cache
from llmfleet.kernels.rotary import check_rotary_args, cos_sin_at, load_rotated
from llmfleet.kernels.rotary_kv_write import rotary_kv_cache_write_ref, write_new_tokens
from llmfleet.kernels.triton_utils import (
    check_last_dim_contiguous,
    interpreting,
    launchable,
    pdl,
)

LOG2E = 1.4426950408889634


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # (num_seqs, num_heads, HEAD_DIM), unit stride in HEAD_DIM; unrotated when ROPE
    kv_ptr,  # (2, num_blocks, CACHE_BLOCK, num_kv_heads, HEAD_DIM), unit stride in HEAD_DIM
    block_tables_ptr,  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens_ptr,  # int32 (num_seqs,)
    out_ptr,  # (num_seqs, num_heads, HEAD_DIM): written when SINGLE_PARTITION or REDUCE_LAST
    part_acc_ptr,  # fp32 (num_seqs, num_heads, num_parts, HEAD_DIM) contiguous
    part_ml_ptr,  # fp32 (2, num_seqs, num_heads, num_parts) contiguous: [0] = m, [1] = l
    arrived_ptr,  # int32 (num_seqs * num_kv_heads,) zeros: programs done per (seq, kv head)
    k_ptr,  # ROPE: (num_seqs, num_kv_heads, HEAD_DIM) new unrotated keys, unit stride in HEAD_DIM
    v_ptr,  # ROPE: their values, same shape; strides may differ (q, k, v: views of one qkv)
    pos_ptr,  # ROPE: int64 (num_seqs,) each new token's row of cos_sin
    cos_sin_ptr,  # ROPE: (max_position, 2 * HALF) contiguous: [cos | sin]
    slot_ptr,  # ROPE: int64 (num_seqs,) each new token's cache slot, < 0 = not written
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    min_partition,  # fewest tokens per partition, a multiple of BLOCK_N
    num_parts,  # partitions per sequence (grid dim 2)
    stride_ml,  # elements between the m and l halves of part_ml
    stride_q_seq,  # elements between sequences of q
    stride_q_head,  # elements between heads of q
    stride_o_seq,  # elements between sequences of out
    stride_o_head,  # elements between heads of out
    stride_c_kv,  # elements between the K and V halves of the cache
    stride_c_block,  # elements between cache blocks
    stride_c_off,  # elements between slots of one block
    stride_c_head,  # elements between kv heads of one slot
    stride_bt_seq,  # elements between rows of block_tables
    stride_k_seq,  # ROPE: elements between sequences of k
    stride_k_head,  # ROPE: elements between heads of k
    stride_v_seq,  # ROPE: elements between sequences of v
    stride_v_head,  # ROPE: elements between heads of v
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tensor-core rows)
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,  # tokens per cache block (power of two)
    BLOCK_N: tl.constexpr,  # tokens per inner iteration
    SINGLE_PARTITION: tl.constexpr,
    REDUCE_LAST: tl.constexpr,  # the last program of a (seq, kv head) combines the partitions
    REDUCE_PARTS: tl.constexpr,  # partitions REDUCE_LAST combines per step
    ROPE: tl.constexpr,  # rotate q, and write this step's rotated k and v to the cache first
    HALF: tl.constexpr,  # ROPE: rot_dim // 2
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    if PDL:  # the next kernel may launch; this one waits below, after its early loads
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)  # the step's metadata: read before the wait
    partition_size = partition_size_of(seq_len, min_partition, num_parts, BLOCK_N)
    start = part * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    used = tl.cdiv(seq_len, partition_size)  # partitions holding tokens: [0, used)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads of this group
    gmask = g < GROUP
    if start < seq_len:  # else nothing to read; the reduction ignores partitions past the end
        d = tl.arange(0, HEAD_DIM)[None, :]
        # Before the wait (module docstring): the block table's entries for the first tile,
        # and with ROPE its keys and values as cached by earlier steps and this row's cos/sin.
        n = start + tl.arange(0, BLOCK_N)  # the first tile's positions
        nmask = n < end
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        kv_head_ptr = kv_ptr + kv_head * stride_c_head  # this KV head's keys in the cache
        k_ptrs = _tile_ptrs(
            kv_head_ptr, table_ptr, n, nmask, d, stride_c_block, stride_c_off, CACHE_BLOCK
        )
        if ROPE:
            k0 = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
            v0 = tl.load(k_ptrs + stride_c_kv, mask=nmask[:, None], other=0.0)
            cos, sin = cos_sin_at(cos_sin_ptr, tl.load(pos_ptr + seq), d, HALF)
        if PDL:
            gdc_wait()  # the kernel before has ended (ROPE: q, k and v's projection)
        if not ROPE:  # the kernel before may have been the one that cached this step's tokens
            k0 = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
            v0 = tl.load(k_ptrs + stride_c_kv, mask=nmask[:, None], other=0.0)
        q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d
        if ROPE:
            q = load_rotated(q_ptrs, d, gmask[:, None], cos, sin, HALF, HEAD_DIM)
            stored = write_new_tokens(
                k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, kv_ptr, table_ptr, seq, kv_head,
                seq_len, start, end, stride_k_seq, stride_k_head, stride_v_seq, stride_v_head,
                stride_c_kv, stride_c_block, stride_c_off, stride_c_head,
                HEAD_DIM, CACHE_BLOCK, HALF,
            )  # fmt: skip
            if stored > 0:
                tl.debug_barrier()  # the loads below see this program's cache stores
                # The tokens it stored are the partition's last `stored` positions: where the
                # first tile holds them, its early loads read what was there before.
                fresh = (nmask & (n >= end - stored))[:, None]
                k0 = tl.where(fresh, tl.load(k_ptrs, mask=fresh, other=0.0), k0)
                v0 = tl.where(fresh, tl.load(k_ptrs + stride_c_kv, mask=fresh, other=0.0), v0)
        else:
            q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)  # (BLOCK_G, HEAD_DIM)
        # One partition holds the whole context: its program writes the output itself
        # (with REDUCE_LAST; the reduction kernel, when it runs, reads partials).
        direct = ((used == 1) & REDUCE_LAST) | SINGLE_PARTITION
        _attend_partition(
            q, k0, v0, nmask, kv_head_ptr, table_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
            qk_scale, num_parts, stride_ml, stride_o_seq, stride_o_head,
            stride_c_kv, stride_c_block, stride_c_off,
            seq, part, start, end, heads, gmask, direct,
            NUM_HEADS, BLOCK_G, HEAD_DIM, CACHE_BLOCK, BLOCK_N,
        )  # fmt: skip
        if REDUCE_LAST:
            # Only the programs of used partitions report: the one that arrives last combines
            # (a grid sized for the longest context leaves most programs of a short one idle,
            # and their reports would queue on the counter's one address).
            if used > 1:
                tl.debug_barrier()  # this program's partials are stored before it reports
                counter = arrived_ptr + seq * tl.num_programs(1) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                    tl.store(counter, 0)  # re-armed for the next launch (graphs replay it)
                    combine_partitions(
                        out_ptr, part_acc_ptr, part_ml_ptr, seq, heads, gmask, used,
                        num_parts, stride_ml, stride_o_seq, stride_o_head, NUM_HEADS, BLOCK_G,
                        HEAD_DIM, REDUCE_PARTS,
                    )  # fmt: skip
    elif PDL:  # nothing to do, but wait all the same: this kernel must not end before the
        gdc_wait()  # one before it (triton_utils.pdl_start), though no program has work


@triton.jit
def _tile_ptrs(kv_head_ptr, table_ptr, n, nmask, d, stride_c_block, stride_c_off,
               CACHE_BLOCK: tl.constexpr):  # fmt: skip
    """(BLOCK_N, HEAD_DIM) pointers to the keys of positions n of one KV head (values: plus
    stride_c_kv), through the sequence's block table row at table_ptr."""
    block = tl.load(table_ptr + n // CACHE_BLOCK, mask=nmask, other=0).to(tl.int64)
    row = block * stride_c_block + (n % CACHE_BLOCK) * stride_c_off  # (BLOCK_N,)
    return kv_head_ptr + row[:, None] + d


@triton.jit
def _online_softmax_step(q, k, v, nmask, m_i, l_i, acc, qk_scale):
    """One tile of keys and values into the running (m, l, acc) of the query heads."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_G, BLOCK_N)
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_partition(
    q, k0, v0, nmask0, kv_head_ptr, table_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
    num_parts, stride_ml, stride_o_seq, stride_o_head, stride_c_kv, stride_c_block,
    stride_c_off, seq, part, start, end, heads, gmask, direct,
    NUM_HEADS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Tokens [start, end) of one KV head (its keys at kv_head_ptr) against the (BLOCK_G,
    HEAD_DIM) query tile q of its query heads, the first tile's keys and values given (k0, v0
    at positions start + i where nmask0): the normalized output (`direct`: this partition is
    the whole context), else the partition's (m, l, acc) per query head."""
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m_i, l_i, acc = _online_softmax_step(q, k0, v0, nmask0, m_i, l_i, acc, qk_scale)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) token positions
        nmask = n < end
        k_ptrs = _tile_ptrs(
            kv_head_ptr, table_ptr, n, nmask, d[None, :], stride_c_block, stride_c_off,
            CACHE_BLOCK,
        )  # fmt: skip
        k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
        v = tl.load(k_ptrs + stride_c_kv, mask=nmask[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, nmask, m_i, l_i, acc, qk_scale)

    if direct:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
        tl.store(o_ptrs + d[None, :], out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        idx = (seq.to(tl.int64) * NUM_HEADS + heads) * num_parts + part  # (BLOCK_G,)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + idx, m_i, mask=gmask)
        tl.store(part_ml_ptr + stride_ml + idx, l_i, mask=gmask)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters. `partition_size` None = chosen from the batch to fill the GPU.
    The defaults are the fastest tile and pipeline of `bench_attention --sweep` at 8B-class
    decode shapes (more warps or 128-token tiles are slower)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    partition_size: int | None = None
    # Auto mode's fewest tokens per partition: below it the partial results' round trip
    # (fp32 acc, m, l per query head) stops paying for the extra parallelism.
    min_partition: int = 128
    # Split contexts: the last program of each (sequence, KV head) to finish combines the
    # partitions (one kernel) instead of a second reduction kernel.
    reduce_last: bool = True


def default_decode_config() -> DecodeConfig:
    if interpreting():
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1)
    return DecodeConfig()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_partitions(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_n: int,
    num_sms: int,
    min_partition: int,
) -> tuple[int, int]:
    """(num_parts, min_partition rounded up to block_n): split contexts only as far as needed
    for ~4 programs per SM, into partitions of at least `min_partition` tokens. A batch that
    already gives nearly that many (64 sequences x 8 KV heads on 132 SMs: 3.9 per SM) is not
    split: a second partition would add the reduction pass and the partial results' round
    trip for no more parallelism."""
    min_part = math.ceil(max(min_partition, block_n) / block_n) * block_n
    base_programs = max(num_seqs * num_kv_heads, 1)
    want_parts = max(1, (4 * num_sms) // base_programs)
    max_parts = max(1, math.ceil(max_seq_len / min_part))
    return min(want_parts, max_parts), min_part


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    check_q_and_kv_cache(q, kv_cache)
    num_seqs = q.shape[0]
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"seq_lens must be int32 ({num_seqs},), got {seq_lens.dtype} {seq_lens.shape}"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 (seqs, max_blocks), got {block_tables.dtype}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")


@dataclass(frozen=True)
class _NewTokens:
    """The ROPE launch's extra arguments: the new tokens' unrotated k and v, their rotary
    positions (int64) and [cos | sin] table (contiguous), and their cache slots."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


def paged_attention_decode(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim): the one new token of each sequence
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens: torch.Tensor,  # int32 (num_seqs,), context incl. the new token (already cached)
    scale: float,
    max_seq_len: int,  # host-side max(seq_lens): sizes the grid without a device sync
    out: torch.Tensor | None = None,  # (num_seqs, num_heads, head_dim)
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton decode attention; returns out (num_seqs, num_heads, head_dim)."""
    _check(q, kv_cache, block_tables, seq_lens)
    return _launch(q, kv_cache, block_tables, seq_lens, scale, max_seq_len, out, config, None)


def paged_attention_decode_rope(
    positions: torch.Tensor,  # int (num_seqs,): each new token's row of cos_sin_cache
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim), unrotated; read only
    k: torch.Tensor,  # (num_seqs, num_kv_heads, head_dim), unrotated; read only
    v: torch.Tensor,  # (num_seqs, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) = [cos | sin]
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), in place
    slot_mapping: torch.Tensor,  # int64 (num_seqs,), < 0 = padding: not written
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens: torch.Tensor,  # int32 (num_seqs,) >= 1, context incl. the new token
    scale: float,
    max_seq_len: int,  # host-side max(seq_lens): sizes the grid without a device sync
    out: torch.Tensor | None = None,  # (num_seqs, num_heads, head_dim)
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """`rotary_kv_cache_write` then `paged_attention_decode`, in one launch, with the same
    output and cache contents; returns out (num_seqs, num_heads, head_dim).

    The rotation happens in registers: q and k are left unrotated in their memory (nothing
    reads them after attention), and the cache receives the rotated k and v at each row's
    slot. The new token of row i is at position seq_lens[i] - 1 of its context. Rows of one
    sequence (its drafts as decode rows, each seeing the rows before it) must be consecutive
    and in position order: a row's programs also write the tokens of the rows just before it
    that fall in their partitions, since those rows' programs may run later."""
    _check(q, kv_cache, block_tables, seq_lens)
    check_rotary_args(positions, q, k, cos_sin_cache)
    check_kv_write_args(k, v, kv_cache, slot_mapping)
    for name, t in (("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    new = _NewTokens(k, v, positions.to(torch.int64), cos_sin_cache.contiguous(), slot_mapping)
    return _launch(q, kv_cache, block_tables, seq_lens, scale, max_seq_len, out, config, new)


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None,
    config: DecodeConfig | None,
    new: _NewTokens | None,  # ROPE: rotate q, write the new tokens' k and v first
) -> torch.Tensor:
    out = attention_output(q, kv_cache, block_tables, out)
    num_seqs, num_heads, head_dim = q.shape
    _, _, cache_block, num_kv_heads, _ = kv_cache.shape
    if num_seqs == 0 or max_seq_len <= 0:
        return out
    cfg = config or default_decode_config()
    if cfg.partition_size is None:
        num_parts, min_part = choose_partitions(
            num_seqs,
            num_kv_heads,
            max_seq_len,
            cfg.block_n,
            _num_sms(q.device),
            cfg.min_partition,
        )
    else:
        if cfg.partition_size <= 0 or cfg.partition_size % cfg.block_n:
            raise ValueError(
                f"partition_size {cfg.partition_size} must be a positive multiple of {cfg.block_n}"
            )
        min_part = cfg.partition_size
        num_parts = triton.cdiv(max_seq_len, min_part)
    single = num_parts == 1
    group = num_heads // num_kv_heads
    if single:
        part_acc = part_ml = out  # unused placeholders
    else:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (2, num_seqs, num_heads, num_parts), dtype=torch.float32, device=q.device
        )
    if new is None:  # placeholders of the ROPE arguments, never read
        k = v = cos_sin = q
        positions = slots = seq_lens
        new_strides = (0, 0, 0, 0)
    else:
        k, v, positions, cos_sin, slots = new.k, new.v, new.positions, new.cos_sin, new.slot_mapping
        new_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    chained = pdl(q.device)
    arrived = None if single or not cfg.reduce_last else arrival_counters(q.device)
    if arrived is not None and arrived.numel() < num_seqs * num_kv_heads:
        arrived = None  # more (sequence, KV head) pairs than counters: the reduction kernel
    launchable(_decode_partial_kernel)[(num_seqs, num_kv_heads, num_parts)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        arrived if arrived is not None else seq_lens,
        k,
        v,
        positions,
        cos_sin,
        slots,
        scale * LOG2E,
        min_part,
        num_parts,
        num_seqs * num_heads * num_parts,
        *attention_strides(q, out, kv_cache, block_tables),
        *new_strides,
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        CACHE_BLOCK=cache_block,
        BLOCK_N=cfg.block_n,
        SINGLE_PARTITION=single,
        REDUCE_LAST=arrived is not None,
        REDUCE_PARTS=4,
        ROPE=new is not None,
        HALF=0 if new is None else cos_sin.shape[1] // 2,
        PDL=chained,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=chained,
    )
    if not single and arrived is None:
        launchable(decode_reduce_kernel)[(num_seqs, num_heads)](
            seq_lens,
            out,
            part_acc,
            part_ml,
            min_part,
            num_parts,
            num_seqs * num_heads * num_parts,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_N=cfg.block_n,
            BLOCK_P=triton.next_power_of_2(num_parts),
            PDL=chained,
            num_warps=4,
            launch_pdl=chained,
        )
    return out


def paged_attention_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """PyTorch reference of `paged_attention_decode`: gathers each sequence's context from the
    cache and runs softmax(q k^T * scale) v in fp32 (`config` is accepted and ignored)."""
    _check(q, kv_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    result = torch.empty_like(q) if out is None else out
    lens = seq_lens.tolist()
    for i in range(num_seqs):
        n = lens[i]
        pos = torch.arange(n, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        k = kv_cache[0, blocks, pos % block_size].float()  # (n, Hkv, D)
        v = kv_cache[1, blocks, pos % block_size].float()
        k = k.repeat_interleave(group, dim=1)  # (n, H, D)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        result[i] = torch.einsum("hn,nhd->hd", s.softmax(dim=-1), v).to(q.dtype)
    return result


def paged_attention_decode_rope_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """PyTorch reference of `paged_attention_decode_rope`: `rotary_kv_cache_write_ref` on
    copies of q and k (which the kernel leaves unrotated), then `paged_attention_decode_ref`."""
    _check(q, kv_cache, block_tables, seq_lens)
    q, k = q.clone(), k.clone()
    rotary_kv_cache_write_ref(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)
    return paged_attention_decode_ref(
        q, kv_cache, block_tables, seq_lens, scale, max_seq_len, out, config
    )
