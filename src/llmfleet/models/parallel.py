"""Tensor parallelism: the process group a model shard runs its collectives on, and how heads,
rows and columns are split across its ranks (Megatron style).

A model built with `TensorParallel(rank, size, group)` holds rank `rank`'s shard of every split
weight; every rank must call `forward` with the same inputs in the same order, since the
collectives inside pair up by call order. At size 1 (`SINGLE`) every collective is a no-op
and the model is exactly the unsplit one.

A `Shard` names the part of a full tensor a rank holds: (dim, pieces), the pieces being index
ranges along `dim` concatenated in order (a fused [gate | up] weight's shard is two pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Shard = tuple[int, tuple[range, ...]]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. `group` is the torch.distributed
    ProcessGroup of the `size` ranks (None at size 1, or for the default group). `peer`, where
    the ranks are GPUs of one host, is the group's one-shot all-reduce over their memory
    (kernels/all_reduce.py): small sums go to it, the rest to the group's backend."""

    rank: int = 0
    size: int = 1
    group: Any = None
    peer: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place; returns `t`."""
        if self.peer is not None and self.peer.fits(t):
            return self.peer(t)
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` (all of one shape) concatenated along `dim` in rank order."""
        if self.size == 1:
            return t
        if t.is_cuda:  # one flat buffer, no copies out of it where the layout allows a view
            flat = t.new_empty((self.size, *t.shape))  # (size, *t.shape)
            dist.all_gather_into_tensor(flat, t.contiguous(), group=self.group)
            d = dim % t.dim()
            full = flat.movedim(0, d)  # (..., size, t.shape[d], ...)
            return full.reshape(*t.shape[:d], self.size * t.shape[d], *t.shape[d + 1 :])
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_gather_into(self, parts: torch.Tensor) -> torch.Tensor:
        """In place: `parts` (size, ...) holds this rank's part at index `rank`; afterwards
        every rank's, in rank order. Returns `parts`."""
        if self.size > 1:
            if parts.is_cuda:
                dist.all_gather_into_tensor(parts, parts[self.rank], group=self.group)
            else:
                every = [parts[r] for r in range(self.size)]
                dist.all_gather(every, parts[self.rank].clone(), group=self.group)
        return parts

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `t` with group rank `src`'s `t`, in place; returns `t`."""
        if self.size > 1:
            dist.broadcast(t, group=self.group, group_src=src)
        return t


SINGLE = TensorParallel()


def split_evenly(n: int, parts: int, index: int) -> range:
    """Part `index` of 0..n-1 cut into `parts` contiguous runs as even as possible (the first
    n % parts runs one longer)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def kv_head_partition(num_kv_heads: int, num_heads: int, size: int) -> list[tuple[range, range]]:
    """Per rank, (its KV heads, its query heads), global head indices.

    Query head h reads KV head h // G (G = num_heads // num_kv_heads), so a rank's query heads
    are the groups of its KV heads. With num_kv_heads >= size the KV heads are split as evenly
    as possible (9 query / 3 KV heads at size 2: KV [0, 2) with queries [0, 6), KV [2, 3)
    with queries [6, 9)). With fewer KV heads than ranks each KV head is replicated on the
    ranks of its run (size // num_kv_heads of them when that divides) and its G query heads
    are split among those ranks.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads not divisible by {num_kv_heads} KV heads")
    if size > num_heads:
        raise ValueError(f"{num_heads} query heads cannot be split over {size} ranks")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        out = []
        for r in range(size):
            kv = split_evenly(num_kv_heads, size, r)
            out.append((kv, range(kv.start * group, kv.stop * group)))
        return out
    out = []
    for kv in range(num_kv_heads):
        ranks = split_evenly(size, num_kv_heads, kv)  # at most G of them, as size <= H
        for i in range(len(ranks)):
            q = split_evenly(group, len(ranks), i)
            out.append((range(kv, kv + 1), range(kv * group + q.start, kv * group + q.stop)))
    return out


def take_shard(t: Any, shard: Shard | None) -> torch.Tensor:
    """The part of `t` that `shard` names (all of it when None). `t` is a tensor or anything
    indexed like one, such as a lazy safetensors slice (then only that part is read)."""
    if shard is None:
        return t if isinstance(t, torch.Tensor) else t[:]
    dim, pieces = shard
    ndim = t.dim() if isinstance(t, torch.Tensor) else len(t.get_shape())
    index: list[slice] = [slice(None)] * ndim
    parts = []
    for piece in pieces:
        index[dim] = slice(piece.start, piece.stop)
        parts.append(t[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
