"""MoE routing: top-k experts per token from router logits, and sorting token slots by expert.

`topk_routing(logits (T, E), k)` -> weights (T, k) float32, ids (T, k) int32, experts in
descending score order. Scoring is softmax over all E (then top-k, optionally renormalized to sum
to one, as Mixtral and Qwen3-MoE do) or an independent sigmoid per expert.

`moe_align_block_size(ids (T, k), E, BLOCK_M)` groups the T * k token slots (slot s = t * k + j)
by expert so the grouped GEMM sees, per block of BLOCK_M rows, a single expert:

    sorted_token_ids  (max_padded,) int32   expert 0's slots, padded with T*k to a multiple of
                                             BLOCK_M, then expert 1's, ...; slots of one expert
                                             keep ascending order; empty experts take no room
    expert_ids        (max_padded // BLOCK_M,) int32   the expert of each block
    num_post_padded   (1,) int32             rows in use: sum over experts of round_up(count)

    e.g. BLOCK_M = 4, counts (3, 0, 5):  [s s s P | s s s s | s P P P]  expert_ids [0, 2, 2]

Entries past num_post_padded are T*k (slots) and E (blocks); the GEMM launches for max_padded
rows (a bound known without a device sync) and its programs past num_post_padded exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORING = ("softmax", "sigmoid")
ONE_PROGRAM_CELLS = 16384  # slots x experts up to which one program sorts all slots


@triton.jit
def _topk_routing_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    T,
    E,
    stride_lt,  # elements between tokens of logits (T, E); unit-stride along E
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # BLOCK_T tokens per program; top-k by TOP_K rounds of (argmax, mask out the winner).
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e[None, :] < E
    x = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
        mask=t_mask[:, None] & e_mask,
        other=-float("inf"),
    ).to(tl.float32)
    x = tl.where(t_mask[:, None], x, 0.0)  # rows past T: finite, never stored
    if SIGMOID:
        scores = tl.where(e_mask, 1.0 / (1.0 + tl.exp(-x)), -1.0)
    else:
        x = x - tl.max(x, axis=1)[:, None]
        p = tl.where(e_mask, tl.exp(x), 0.0)
        scores = tl.where(e_mask, p / tl.sum(p, axis=1)[:, None], -1.0)
    # Winners gather in (BLOCK_T, BLOCK_K) register tiles, column j = j-th best.
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=1)  # (BLOCK_T,)
        # Lowest index among equal maxima (deterministic ties).
        idx = tl.min(tl.where(scores == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        top_w = tl.where(offs_k[None, :] == j, best[:, None], top_w)
        top_i = tl.where(offs_k[None, :] == j, idx[:, None], top_i)
        scores = tl.where(offs_e[None, :] == idx[:, None], -2.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out = offs_t[:, None].to(tl.int64) * TOP_K + offs_k[None, :]
    o_mask = t_mask[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=o_mask)
    tl.store(ids_ptr + out, top_i, mask=o_mask)


def topk_routing(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token: (weights (T, k) float32, ids (T, k) int32), best first."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (T, E), got {tuple(router_logits.shape)}")
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in 1..{e}, got {top_k}")
    if e > 1 and router_logits.stride(1) != 1:
        raise ValueError("router_logits must be unit-stride along E")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(64, 4096 // block_e))
    _topk_routing_kernel[(triton.cdiv(t, block_t),)](
        router_logits,
        weights,
        ids,
        t,
        e,
        router_logits.stride(0),
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return weights, ids


def topk_routing_ref(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `topk_routing`."""
    x = router_logits.float()
    scores = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ---- sorting token slots by expert ----


@triton.jit
def _count_kernel(
    ids_ptr,
    chunk_counts_ptr,
    rank_ptr,
    numel,
    E,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Program c takes slots [c*CHUNK, (c+1)*CHUNK): counts per expert -> chunk_counts[c, :]
    # (row-major (num_chunks, E)), and each slot's rank among its chunk's slots of the same
    # expert -> rank[slot]. A one-hot (CHUNK, BLOCK_E) tile and a column cumsum do both.
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=BLOCK_E)  # BLOCK_E matches no column
    offs_e = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
    before = tl.cumsum(onehot, axis=0) - onehot
    rank = tl.sum(before * onehot, axis=1)
    tl.store(rank_ptr + offs, rank, mask=mask)
    tl.store(chunk_counts_ptr + c * E + offs_e, tl.sum(onehot, axis=0), mask=offs_e < E)


@triton.jit
def _offsets_kernel(
    chunk_counts_ptr,
    chunk_offsets_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_chunks,
    numel,
    E,
    max_padded,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
):
    # One program. chunk_offsets[c, e] = start of expert e's region + slots of e in chunks < c.
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        m = (offs_c[:, None] < num_chunks) & e_mask[None, :]
        cnt = tl.load(chunk_counts_ptr + offs_c[:, None] * E + offs_e[None, :], mask=m, other=0)
        totals += tl.sum(cnt, axis=0)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    num_post_padded = tl.sum(padded, axis=0)
    tl.store(num_post_padded_ptr, num_post_padded)

    running = starts
    for c0 in range(0, num_chunks, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        m = (offs_c[:, None] < num_chunks) & e_mask[None, :]
        ptrs = offs_c[:, None] * E + offs_e[None, :]
        cnt = tl.load(chunk_counts_ptr + ptrs, mask=m, other=0)
        incl = tl.cumsum(cnt, axis=0)
        tl.store(chunk_offsets_ptr + ptrs, running[None, :] + incl - cnt, mask=m)
        running += tl.sum(cnt, axis=0)

    _fill_padding(sorted_ids_ptr, expert_ids_ptr, ends, e_mask, numel, max_padded, BLOCK_M,
                  BLOCK_FILL)  # fmt: skip


@triton.jit
def _fill_padding(
    sorted_ids_ptr, expert_ids_ptr, ends, e_mask, numel, max_padded,
    BLOCK_M: tl.constexpr, BLOCK_FILL: tl.constexpr,
):  # fmt: skip
    # Padding rows get the out-of-range slot `numel`; the scatter overwrites real ones.
    # Block b belongs to the expert whose [start, end) holds b * BLOCK_M: count experts ending
    # at or before it (empty experts have start == end and are skipped by the count).
    ends_m = tl.where(e_mask, ends, 2147483647)
    for r0 in range(0, max_padded, BLOCK_FILL):
        offs_r = r0 + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ids_ptr + offs_r, tl.zeros_like(offs_r) + numel, mask=offs_r < max_padded)
    for b0 in range(0, max_padded // BLOCK_M, BLOCK_FILL):
        offs_b = b0 + tl.arange(0, BLOCK_FILL)
        row = offs_b * BLOCK_M
        eid = tl.sum((ends_m[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + offs_b, eid, mask=offs_b < max_padded // BLOCK_M)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, numel, E, max_padded,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
):  # fmt: skip
    # All slots fit one CHUNK: count, offsets and scatter of the three-kernel path in a single
    # program (a decode step's few slots would otherwise pay for three launches).
    offs = tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=BLOCK_E)  # BLOCK_E matches no column
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    padded = tl.cdiv(tl.sum(onehot, axis=0), BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    _fill_padding(sorted_ids_ptr, expert_ids_ptr, ends, e_mask, numel, max_padded, BLOCK_M,
                  BLOCK_FILL)  # fmt: skip
    # Every thread's padding stores land before any slot is written over them.
    tl.debug_barrier()
    dest = tl.sum(onehot * (ends - padded)[None, :], axis=1) + rank
    tl.store(sorted_ids_ptr + dest, offs, mask=mask)


@triton.jit
def _scatter_kernel(
    ids_ptr,
    rank_ptr,
    chunk_offsets_ptr,
    sorted_ids_ptr,
    numel,
    E,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.load(rank_ptr + offs, mask=mask, other=0)
    dest = tl.load(chunk_offsets_ptr + c * E + ids, mask=mask, other=0) + rank
    tl.store(sorted_ids_ptr + dest, offs, mask=mask)


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Upper bound on num_post_padded, known on the host: each non-empty expert adds at most
    block_m - 1 padding rows, and at most min(numel, E) experts are non-empty."""
    return numel + min(numel, num_experts) * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k token slots by expert, padded per expert to multiples of `block_m`.

    Returns (sorted_token_ids (max_padded,), expert_ids (max_padded // block_m,),
    num_post_padded (1,)), all int32; see the module docstring for the layout.
    Every id must lie in [0, num_experts).
    """
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be a contiguous int32 tensor")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    numel = topk_ids.numel()
    dev = topk_ids.device
    max_padded = triton.cdiv(max_padded_rows(numel, num_experts, block_m), block_m) * block_m
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    expert_ids = torch.empty((max_padded // block_m,), dtype=torch.int32, device=dev)
    if numel == 0:
        return sorted_ids, expert_ids, torch.zeros((1,), dtype=torch.int32, device=dev)
    num_post_padded = torch.empty((1,), dtype=torch.int32, device=dev)  # the kernels store it
    block_e = triton.next_power_of_2(num_experts)
    block_fill = max(16, min(1024, 16384 // block_e))
    if numel <= max(16, ONE_PROGRAM_CELLS // block_e):
        _align_one_program_kernel[(1,)](
            topk_ids, sorted_ids, expert_ids, num_post_padded, numel, num_experts, max_padded,
            BLOCK_M=block_m, CHUNK=max(16, triton.next_power_of_2(numel)), BLOCK_E=block_e,
            BLOCK_FILL=block_fill, num_warps=4,
        )  # fmt: skip
        return sorted_ids, expert_ids, num_post_padded
    chunk = max(16, min(256, 8192 // block_e))
    num_chunks = triton.cdiv(numel, chunk)
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=dev)
    chunk_offsets = torch.empty_like(chunk_counts)
    rank = torch.empty((numel,), dtype=torch.int32, device=dev)
    flat = topk_ids.view(-1)
    _count_kernel[(num_chunks,)](
        flat, chunk_counts, rank, numel, num_experts, CHUNK=chunk, BLOCK_E=block_e
    )
    _offsets_kernel[(1,)](
        chunk_counts,
        chunk_offsets,
        sorted_ids,
        expert_ids,
        num_post_padded,
        num_chunks,
        numel,
        num_experts,
        max_padded,
        BLOCK_M=block_m,
        BLOCK_C=max(1, min(64, 4096 // block_e)),
        BLOCK_E=block_e,
        BLOCK_FILL=block_fill,
        num_warps=8,
    )
    _scatter_kernel[(num_chunks,)](
        flat, rank, chunk_offsets, sorted_ids, numel, num_experts, CHUNK=chunk
    )
    return sorted_ids, expert_ids, num_post_padded


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of `moe_align_block_size` (same outputs, element for element)."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_padded = triton.cdiv(max_padded_rows(numel, num_experts, block_m), block_m) * block_m
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32)
    expert_ids = torch.full((max_padded // block_m,), num_experts, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        slots = torch.nonzero(flat.cpu() == e).flatten()
        if slots.numel() == 0:
            continue
        sorted_ids[pos : pos + slots.numel()] = slots.to(torch.int32)
        padded = triton.cdiv(slots.numel(), block_m) * block_m
        expert_ids[pos // block_m : (pos + padded) // block_m] = e
        pos += padded
    dev = topk_ids.device
    return (
        sorted_ids.to(dev),
        expert_ids.to(dev),
        torch.tensor([pos], dtype=torch.int32, device=dev),
    )
