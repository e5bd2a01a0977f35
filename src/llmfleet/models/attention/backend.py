"""The attention backend interface every model layer calls.

A backend owns two things for one layer call: writing this step's keys and values into the
paged cache (at `meta.slot_mapping`), then causal attention of each new query token over its
sequence's whole context (cached prefix + this step's tokens). Given the layer's rotary inputs
(`rope=`), it applies the rotary embedding to q and k first, so that a backend can fuse it
with the cache write. The CPU reference lives in
`reference.py`; Triton backends arrive with the kernels.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.rotary import RotaryPositions


class AttentionBackend(Protocol):
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
        so in place, in q's and k's memory (which may be views of one fused qkv activation).
        Without it, q and k are already rotated and only the cache is written."""
        ...
