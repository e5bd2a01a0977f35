"""Embedding lookup in one rank's rows of a vocabulary-parallel table.

    ids (T,) int64, weight (rows, H): this rank's vocabulary [start, start + rows)
    out[t] = weight[ids[t] - start] if start <= ids[t] < start + rows, else zeros

Summed over the group, every rank gets the full embedding. torch takes six kernels for this
(the shift, two compares, a masked fill of the ids, the lookup, a masked fill of the rows);
at the head of a decode step each is a launch on the chain, so here it is one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl, pdl_start

BLOCK = 1024  # columns per program


@triton.jit
def _shard_embedding_kernel(
    ids_ptr,  # int64 (T,)
    w_ptr,  # (rows, H), unit stride in H
    out_ptr,  # (T, H) contiguous
    start,  # the first id of this rank's rows
    rows,
    H,
    stride_w,  # elements between rows of the table
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    local = tl.load(ids_ptr + tok).to(tl.int64) - start + tl.zeros([BLOCK], tl.int64)
    inside = (local >= 0) & (local < rows)  # (per column: a mask of the block's shape)
    row = tl.where(inside, local, 0)
    v = tl.load(w_ptr + row * stride_w + cols, mask=cmask & inside, other=0.0)
    tl.store(out_ptr + tok * H + cols, v, mask=cmask)


def _check(ids: torch.Tensor, weight: torch.Tensor) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32/int64 (T,), got {ids.dtype} {tuple(ids.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (rows, hidden), got {tuple(weight.shape)}")


def shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Triton: (T, H) rows of `weight` for the ids in [start, start + rows), zeros for the
    others."""
    _check(ids, weight)
    check_last_dim_contiguous("weight", weight)
    rows, hidden = weight.shape
    out = torch.empty((ids.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0 or hidden == 0:
        return out
    chained = pdl(weight.device)
    launchable(_shard_embedding_kernel)[(ids.shape[0], triton.cdiv(hidden, BLOCK))](
        ids, weight, out, start, rows, hidden, weight.stride(0), BLOCK=BLOCK, PDL=chained,
        num_warps=4, launch_pdl=chained,
    )  # fmt: skip
    return out


def shard_embedding_ref(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """PyTorch reference of `shard_embedding`."""
    _check(ids, weight)
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill_(outside.unsqueeze(-1), 0.0)
