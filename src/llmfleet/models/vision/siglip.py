"""SigLIP's vision transformer (as LLaVA-style models use it): patch embeddings (with bias)
plus learned positions, no class token, the ViT encoder.

Parameter names are HF's SiglipVisionModel names without `vision_model.`:

    embeddings.patch_embedding.{weight,bias}  (D, C, P, P), (D,)
    embeddings.position_embedding.weight      ((S/P)^2, D)
    encoder.layers.{i}.*                      (vit.py)

`post_layernorm` and the attention-pooling `head` only feed SigLIP's pooled output, which a
VLM never uses: they are not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmfleet.models.vision.vit import VisionEncoder


class SiglipVisionTower(nn.Module):
    """Hidden states of a SigLIP vision encoder over fixed-size images."""

    num_prefix_tokens = 0

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.image_size, self.patch_size = config.image_size, p
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=p, stride=p)
        self.embeddings.position_embedding = nn.Embedding((config.image_size // p) ** 2, d)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(
        self, pixel_values: torch.Tensor, indices: Sequence[int]
    ) -> list[torch.Tensor]:  # (B, C, S, S) -> [(B, (S/P)^2, D)] at `indices`
        emb = self.embeddings
        x = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (B, N, D)
        return self.encoder(x + emb.position_embedding.weight, indices)
