"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector and a text decoder (Llama or
Qwen2), as HF's LlavaForConditionalGeneration.

An image is one fixed-size (C, S, S) pixel tensor (the processor's `pixel_values` row). Its
features are the tower's hidden states after `vision_feature_layer` (one layer, or several
concatenated on the feature axis), without the first position under the "default" strategy
(CLIP's class token), projected to the decoder's width: (S/P)^2 rows, one per placeholder
(minus one under "default" for a tower without a class token, as HF does).

Parameter tree (HF names after their leading `model.`; transformers 4 and 5 layouts load):

    vision_tower.*            vision/clip.py or vision/siglip.py, up to the deepest feature
                              layer (later layers, post_layernorm and heads are skipped)
    multi_modal_projector.linear_{1,2}.{weight,bias}
    language_model.*          decoder.py

Tensor parallelism: the decoder is sharded; the tower and projector are replicated whole on
every rank, each of which encodes the same images.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmfleet.models.architectures import text_model_class
from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.multimodal import MultimodalCausalLM
from llmfleet.models.parallel import SINGLE, TensorParallel
from llmfleet.models.vision.clip import CLIPVisionTower
from llmfleet.models.vision.siglip import SiglipVisionTower
from llmfleet.models.vision.vit import activation, hidden_state_index
from llmfleet.shared.core.errors import ModelLoadError
from llmfleet.shared.core.multimodal import PixelInput

VISION_TOWERS: dict[str, type[CLIPVisionTower] | type[SiglipVisionTower]] = {
    "clip_vision_model": CLIPVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}
_TOWER_LAYER = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.")
_UNUSED = ("vision_tower.post_layernorm.", "vision_tower.head.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, bias: bool, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultimodalCausalLM):
    """LLaVA-1.5-style models (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        text = config.text_config
        language_model = text_model_class(text)(text, backend, tp)
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = config.image_token_index
        super().__init__(config, language_model, image_token_id)
        vision = config.vision_config
        tower_cls = VISION_TOWERS.get(vision.model_type)
        if tower_cls is None:
            raise ModelLoadError(
                f"LLaVA vision tower {vision.model_type!r} is not supported; "
                f"supported: {', '.join(VISION_TOWERS)}"
            )
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.feature_indices = [hidden_state_index(i, vision.num_hidden_layers) for i in layers]
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {self.select_strategy!r}")
        self.vision_tower = tower_cls(vision, max(self.feature_indices))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(layers),
            text.hidden_size,
            bool(getattr(config, "multimodal_projector_bias", True)),
            config.projector_hidden_act,
        )

    @property
    def tokens_per_image(self) -> int:
        """Placeholder rows per image: the tower's positions, less the "default" strategy's
        first one."""
        tower = self.vision_tower
        n = (tower.image_size // tower.patch_size) ** 2 + tower.num_prefix_tokens
        return n - 1 if self.select_strategy == "default" else n

    def encode_images(self, images: Sequence[PixelInput]) -> list[torch.Tensor]:
        """One (tokens_per_image, hidden) tensor per image; the tower runs once on the stack."""
        if not images:
            return []
        param = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([self._pixels(im, i) for i, im in enumerate(images)])
        pixels = pixels.to(device=param.device, dtype=param.dtype)  # (B, C, S, S)
        states = self.vision_tower(pixels, self.feature_indices)  # [(B, N, D)]
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))  # (B, n, hidden)
        return list(features.unbind(0))

    def _pixels(self, image: PixelInput, index: int) -> torch.Tensor:  # (C, S, S)
        t = image.pixel_values
        if t.dim() == 4 and t.shape[0] == 1:  # the processor's batch of one
            t = t[0]
        tower = self.vision_tower
        want = (tower.embeddings.patch_embedding.in_channels, tower.image_size, tower.image_size)
        if tuple(t.shape) != want:
            raise ValueError(f"image {index}: pixel_values of shape {tuple(t.shape)}, need {want}")
        return t

    def vision_weight_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith("vision_tower.vision_model."):  # transformers 4 / llava-hf layout
            name = "vision_tower." + name[len("vision_tower.vision_model.") :]
        if name.startswith(_UNUSED) or name.endswith("position_ids"):
            return None
        m = _TOWER_LAYER.match(name)
        if m is not None and int(m.group(1)) >= len(self.vision_tower.encoder.layers):
            return None  # after the deepest feature layer: never run
        return name
