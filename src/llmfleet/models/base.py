"""The model interface the engine depends on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from llmfleet.models.attention.metadata import AttentionMetadata


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a flattened varlen batch and a paged KV cache.

    Invariants:
    - `forward` takes the T new tokens of one step (all sequences end to end, no padding) and
      their absolute positions; it writes their keys/values into `kv_caches[layer]` at
      `meta.slot_mapping` (the only state it mutates) and returns final hidden states.
    - `kv_caches` has one tensor per layer, each (2, num_blocks, block_size, Hkv, head_dim),
      owned by the engine.
    - `compute_logits` is applied by the caller to just the rows it samples from.
    - `load_weights` accepts HF parameter names in any order, one tensor at a time; it copies
      into the model's own (possibly fused or stacked) parameters and keeps no reference.
    """

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden_size)
        ...

    @abstractmethod
    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # (N, hidden) -> (N, V) float32, written into `out` when given
        ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
