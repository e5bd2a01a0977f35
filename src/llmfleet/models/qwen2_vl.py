"""Qwen2-VL: the vision transformer of vision/qwen2_vl.py and a Qwen2 decoder with M-RoPE.

Each image of grid (t, h, w) patches is t*h*w / m^2 `<|image_pad|>` tokens in the prompt (m the
spatial merge size), whose embeddings the vision tower's output rows replace in order.

M-RoPE positions (`rope_positions`, transformers' `get_rope_index` for images): text tokens
count up by one on all three axes; an image starting at the running position s gives its
token (ti, hi, wi) of the merged grid the positions (s + ti, s + hi, s + wi), and the text after
it resumes at s + max(h, w) / m. A prompt of L tokens whose largest position is p has
delta = p + 1 - L: generated token i (i >= L) sits at i + delta on every axis.

Checkpoint names: transformers-5 `model.visual.*`, `model.language_model.*`, `lm_head.weight`;
the hub layout (which transformers 5 also writes) `visual.*`, `model.*`, `lm_head.weight`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.multimodal import MultimodalCausalLM
from llmfleet.models.parallel import SINGLE, TensorParallel
from llmfleet.models.vision.qwen2_vl import Qwen2VisionTransformer
from llmfleet.shared.core.multimodal import ImageRef, PixelInput


class Qwen2VLTextDecoder(DecoderForCausalLM):
    """The Qwen2 decoder (bias on q/k/v); its rotary takes (3, T) positions (rotary.py)."""

    qkv_bias = True


class Qwen2VLForConditionalGeneration(MultimodalCausalLM):
    def __init__(
        self,
        config: Any,
        backend: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        text = config.text_config
        super().__init__(config, Qwen2VLTextDecoder(text, backend, tp), config.image_token_id)
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.merge = self.visual.merge

    def encode_images(self, images: Sequence[PixelInput]) -> list[torch.Tensor]:
        """One (t*h*w / m^2, hidden) tensor per image; the tower runs once over all patches."""
        if not images:
            return []
        param = self.visual.patch_embed.proj.weight
        grids = []
        for im in images:
            rows, width = im.pixel_values.shape
            grids.append(self.visual.check_grid(im.grid, rows, width))
        pixels = torch.cat([im.pixel_values for im in images]).to(param.device, param.dtype)
        out = self.visual(pixels, grids)  # (sum of tokens, hidden)
        dtype = self.language_model.embed_tokens.weight.dtype
        parts = out.to(dtype).split([self.visual.num_tokens(g) for g in grids])
        # Own storage per image: a cached entry must not pin the whole batch's output.
        return [p.clone() for p in parts] if len(parts) > 1 else list(parts)

    def rope_positions(
        self, prompt_token_ids: Sequence[int], images: Sequence[ImageRef]
    ) -> tuple[torch.Tensor, int]:  # ((3, L) int64, delta)
        m, n = self.merge, len(prompt_token_ids)
        parts: list[torch.Tensor] = []
        pos = end = 0  # next position; end of the last placeholder run
        for im in sorted(images, key=lambda im: im.offset):
            if len(im.grid) != 3:
                raise ValueError(f"image at {im.offset}: grid {im.grid} is not (t, h, w)")
            t, h, w = (int(g) for g in im.grid)
            gh, gw = h // m, w // m
            if im.length != t * gh * gw or im.offset < end or im.end > n:
                raise ValueError(
                    f"image at {im.offset} of {im.length} tokens does not fit grid {im.grid} "
                    f"(merge {m}) in a prompt of {n} tokens"
                )
            text_len = im.offset - end
            parts.append(torch.arange(pos, pos + text_len).expand(3, -1))
            pos += text_len
            grid = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            )
            parts.append(grid.reshape(3, -1) + pos)  # (3, t*gh*gw): (t, h, w) offsets
            pos += max(h, w) // m
            end = im.end
        parts.append(torch.arange(pos, pos + n - end).expand(3, -1))
        positions = torch.cat(parts, dim=1)  # (3, L)
        delta = int(positions.max()) + 1 - n if n else 0
        return positions, delta

    def text_weight_name(self, name: str) -> str | None:
        if name.startswith(("visual.", "model.visual.")):
            return None
        if name.startswith(("model.", "lm_head.")):  # the hub layout: the decoder is `model.*`
            return name.replace("model.language_model.", "model.", 1)
        return super().text_weight_name(name)

    def vision_weight_name(self, name: str) -> str | None:
        return name.removeprefix("model.")  # visual.*
