"""The attention backend interface every model layer calls.

A backend owns two things for one layer call: writing this step's keys and values into the
paged cache (at `meta.slot_mapping`), then causal attention of each new query token over its
sequence's whole context (cached prefix + this step's tokens). Given the layer's rotary inputs
(`rope=`), it applies the rotary embedding to q and k first, so that a backend can fuse it
with the cache write. `forward` is that sequence of steps; a backend supplies the steps, and
may override `forward` to fuse them further (the Triton backend's pure decode step with rotary
inputs is one kernel: rotation, cache write and attention). The CPU reference lives in
`reference.py`, the Triton kernels' backend in `triton_backend.py`.

Shapes of the steps' arguments: q (num_tokens, num_heads, head_dim), k and v (num_tokens,
num_kv_heads, head_dim), kv_cache (2, num_blocks, block_size, num_kv_heads, head_dim); a pure
decode step has num_tokens == num_seqs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.rotary import RotaryPositions


class AttentionBackend(ABC):
    name: str
    # True when a pure-decode `forward` can be captured in a CUDA graph: no host syncs, launch
    # shapes from `meta.num_seqs` and the bound `meta.max_seq_len` only (which a graph sets to
    # the static context limit), lengths read from the device tensors alone.
    cuda_graph_safe: bool

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
        scale: float,
        *,
        rope: RotaryPositions | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Write k/v into the cache, then attend. GQA: query head h reads KV head
        h // (num_heads // num_kv_heads).

        With `rope`, q and k arrive unrotated: the backend rotates them (neox style, partial
        rotary as `rope.table` says) before writing k to the cache and attending, and may do
        so in place, in q's and k's memory (which may be views of one fused qkv activation),
        or in registers only, leaving that memory unrotated: after the call, callers must not
        read q or k expecting either. Without it, q and k are already rotated and only the
        cache is written.

        In a pure decode step the rows of one sequence (its drafts as rows) are consecutive,
        in position order, and each row sees the keys and values of the rows before it."""
        q, k = self.write_cache(q, k, v, kv_cache, meta.slot_mapping, rope)
        if meta.is_pure_decode:
            return self.decode(q, kv_cache, meta, scale)
        return self.prefill(q, k, v, kv_cache, meta, scale)

    @abstractmethod
    def write_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 (num_tokens,); < 0 = padding, not written
        rope: RotaryPositions | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k and v at their slots, rotating q and k first when `rope` is given; returns
        q and k as rotated (the same tensors where the rotation is in place)."""

    @abstractmethod
    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of a pure decode step (one query per sequence) over the cache."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of any other step (prefill, chunked prefill, mixed); this step's
        k and v are in the cache already and also given."""
