"""The Triton implementation of the worker's `AttentionBackend` protocol.

A pure decode step (every sequence has one new token) given the rotary inputs is one launch
(kernels/paged_attention_decode.py, `paged_attention_decode_rope`): each program of the split-K
decode kernel rotates its query heads in registers, the programs that hold a new token's
position rotate its k and write k and v into the paged cache at `meta.slot_mapping`, then
attend. q and k stay unrotated in memory on that path.

Every other layer call takes two steps: scatter this step's k/v into the paged cache (given the
rotary inputs, rotating q and k in place in the same launch: kernels/rotary_kv_write.py), then
attend: the split-K decode kernel for a pure decode step without rotary inputs, the varlen
prefill kernel for any step with a longer query (prefill, chunked prefill, mixed prefill +
decode), which handles query_len == 1 rows as well.
"""

from __future__ import annotations

import torch

from llmfleet.kernels import dispatch
from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.rotary import RotaryPositions


class TritonAttentionBackend(AttentionBackend):
    """Stateless; `kv_cache` is mutated in place (only at this step's slots)."""

    name = "triton"
    # Decode: the grid and split-K follow num_seqs and the max_seq_len bound; kernels read the
    # true lengths from seq_lens and skip slot -1 (padding), so graphs may replay it.
    cuda_graph_safe = True

    def __init__(self, force_triton: bool = False) -> None:
        # force_triton: run the kernels in Triton's CPU interpreter (tests) instead of
        # falling back to the PyTorch references for CPU tensors.
        self.force_triton = force_triton

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
        """`AttentionBackend.forward`; a pure decode step with `rope` is one kernel, which
        leaves q and k unrotated (the rotated k goes to the cache only)."""
        if rope is None or not meta.is_pure_decode:
            return super().forward(q, k, v, kv_cache, meta, scale, rope=rope)
        return dispatch.paged_attention_decode_rope(
            rope.positions,
            q,
            k,
            v,
            rope.table,
            kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.max_seq_len,
            force_triton=self.force_triton,
        )

    def write_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rope: RotaryPositions | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        force = self.force_triton
        if rope is None:
            dispatch.kv_cache_write(k, v, kv_cache, slot_mapping, force_triton=force)
        else:  # q and k rotated in place, the rotated k written to the cache: one launch
            dispatch.rotary_kv_cache_write(
                rope.positions, q, k, v, rope.table, kv_cache, slot_mapping, force_triton=force
            )
        return q, k

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return dispatch.paged_attention_decode(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.max_seq_len,
            force_triton=self.force_triton,
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # reads k and v from the cache
        return dispatch.paged_attention_prefill(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            force_triton=self.force_triton,
        )
