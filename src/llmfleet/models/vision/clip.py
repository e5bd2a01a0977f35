"""CLIP's vision transformer (as LLaVA uses it): a class token and patch embeddings with learned
positions, a LayerNorm before the encoder (`pre_layrnorm`, HF's spelling), the ViT encoder.

Parameter names are HF's CLIPVisionModel names without `vision_model.`:

    embeddings.class_embedding              (D,)
    embeddings.patch_embedding.weight       (D, C, P, P)   no bias
    embeddings.position_embedding.weight    (1 + (S/P)^2, D)
    pre_layrnorm.{weight,bias}
    encoder.layers.{i}.*                    (vit.py)

`post_layernorm` only feeds CLIP's pooled output, which LLaVA never uses: it is not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmfleet.models.vision.vit import VisionEncoder


class CLIPVisionTower(nn.Module):
    """Hidden states of a CLIP vision encoder over fixed-size images; sequence position 0 is
    the class token."""

    num_prefix_tokens = 1  # the class token

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.image_size, self.patch_size = config.image_size, p
        num_patches = (config.image_size // p) ** 2
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(d))
        self.embeddings.patch_embedding = nn.Conv2d(
            config.num_channels, d, kernel_size=p, stride=p, bias=False
        )
        self.embeddings.position_embedding = nn.Embedding(num_patches + 1, d)
        self.pre_layrnorm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(
        self, pixel_values: torch.Tensor, indices: Sequence[int]
    ) -> list[torch.Tensor]:  # (B, C, S, S) -> [(B, 1 + (S/P)^2, D)] at `indices`
        emb = self.embeddings
        patches = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (B, N, D)
        cls = emb.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + emb.position_embedding.weight
        return self.encoder(self.pre_layrnorm(x), indices)
