"""Split decode attention's partitions combined into one output per query head.

Each program of `paged_attention_decode` covers one partition of a sequence's context and,
when the context has several, stores its partial result: the running max m and sum l of
exp2(score - m) and the unnormalized acc per query head. They combine as

    out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p,    M = max_p m_p

either in the last program of each (sequence, KV head) to finish (`combine_partitions`,
counted on the device's arrival counters, which that program re-arms) or in a second kernel
(`decode_reduce_kernel`) where no counters can serve the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import pdl_start


@triton.jit
def partition_size_of(seq_len, min_partition, num_parts, BLOCK_N: tl.constexpr):
    """Tokens per partition of a sequence of `seq_len`: an even share of its length over
    `num_parts`, in whole tiles, at least `min_partition` (kernels/paged_attention_decode.py)."""
    even = tl.cdiv(tl.cdiv(seq_len, num_parts), BLOCK_N) * BLOCK_N
    return tl.maximum(even, min_partition)


@triton.jit
def combine_partitions(
    out_ptr, part_acc_ptr, part_ml_ptr, seq, heads, gmask, used, num_parts, stride_ml,
    stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """The combination above for the query heads `heads` of one sequence, PARTS partitions a
    step (a running max and sums), written to out. The partials were stored by other programs
    of this launch: read from L2 (.cg), past this SM's L1."""
    d = tl.arange(0, HEAD_DIM)
    base = (seq.to(tl.int64) * NUM_HEADS + heads) * num_parts  # (BLOCK_G,)
    m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_G], tl.float32)
    acc_run = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for p0 in range(0, used, PARTS):
        p = p0 + tl.arange(0, PARTS)
        ok = gmask[:, None] & (p < used)[None, :]  # (BLOCK_G, PARTS)
        idx = base[:, None] + p[None, :]
        m = tl.load(part_ml_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_p = tl.load(part_ml_ptr + stride_ml + idx, mask=ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(
            part_acc_ptr + idx[:, :, None] * HEAD_DIM + d[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # (BLOCK_G, PARTS, HEAD_DIM)
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[:, None])  # (BLOCK_G, PARTS); 0 where masked
        l_run = l_run * alpha + tl.sum(w * l_p, axis=1)
        acc_run = acc_run * alpha[:, None] + tl.sum(acc * w[:, :, None], axis=1)
        m_run = m_new
    out = acc_run / l_run[:, None]
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
    tl.store(o_ptrs + d[None, :], out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def decode_reduce_kernel(
    seq_lens_ptr,  # int32 (num_seqs,)
    out_ptr,  # (num_seqs, num_heads, HEAD_DIM)
    part_acc_ptr,  # fp32 (num_seqs, num_heads, num_parts, HEAD_DIM) contiguous
    part_ml_ptr,  # fp32 (2, num_seqs, num_heads, num_parts) contiguous
    min_partition,
    num_parts,
    stride_ml,  # elements between the m and l halves of part_ml
    stride_o_seq,  # elements between sequences of out
    stride_o_head,  # elements between heads of out
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the first kernel's tile (partition sizes are multiples of it)
    BLOCK_P: tl.constexpr,  # next power of two >= num_parts
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size = partition_size_of(seq_len, min_partition, num_parts, BLOCK_N)
    used = tl.cdiv(seq_len, partition_size)  # partitions the first kernel wrote
    p = tl.arange(0, BLOCK_P)
    pmask = p < used
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_parts
    m = tl.load(part_ml_ptr + base + p, mask=pmask, other=float("-inf"))
    l_p = tl.load(part_ml_ptr + stride_ml + base + p, mask=pmask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(pmask, tl.exp2(m - m_max), 0.0)  # (BLOCK_P,)
    denom = tl.sum(w * l_p, axis=0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        part_acc_ptr + (base + p)[:, None] * HEAD_DIM + d[None, :], mask=pmask[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / denom
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


ARRIVAL_COUNTERS = 1 << 16  # (sequence, KV head) pairs a launch may reduce in its last program
_arrivals: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor | None:
    """This device's zeroed arrival counters, which every launch leaves zeroed again; None
    while a CUDA graph is being captured before they exist (that launch reduces in a second
    kernel), since memory allocated during a capture belongs to that graph. Decode attention
    on one device runs on one stream at a time, so launches never share them concurrently."""
    counters = _arrivals.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _arrivals[device] = torch.zeros(
            ARRIVAL_COUNTERS, dtype=torch.int32, device=device
        )
    return counters
