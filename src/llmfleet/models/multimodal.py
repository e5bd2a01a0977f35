"""The interface of a vision-language model: a vision encoder whose outputs replace the image
placeholder tokens' embeddings, and a text decoder (a `DecoderForCausalLM`) over the paged KV
cache like any text model.

How the engine runs a step with images (the model itself keeps no per-request state):

    emb = model.embed_input_ids(input_ids)                  # (T, hidden)
    feats = model.encode_images(pixels)                     # one (length_i, hidden) per image
    emb[rows of image i's placeholders in this step] = feats[i][the matching slice]
    hidden = model(input_ids, positions, kv_caches, meta, inputs_embeds=emb)

A chunk may hold only part of an image's placeholder run: the runner copies the slice of the
image's rows that falls in the chunk (placeholder k of image i is row k of `feats[i]`). Steps
without images (decode steps, text-only prompts) call `forward` without `inputs_embeds`.

Invariants:
- `image_token_id` is the placeholder token id the processor expands each image into; an image
  whose `ImageRef.length` is n has exactly n placeholders in the prompt, and `encode_images`
  returns exactly n rows for it.
- `encode_images` is deterministic per image: batching images together gives each the rows it
  gets alone (up to float rounding), so its output may be cached by content hash.
- M-RoPE models (Qwen2-VL) take positions (3, T) for prompt tokens from `rope_positions`; every
  other call may pass (T,) positions, meaning the same position on all three axes.
- KV geometry, vocabulary and logits are the text decoder's (`language_model`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.base import CausalLM
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.parallel import Shard, take_shard
from llmfleet.shared.core.errors import ModelLoadError
from llmfleet.shared.core.multimodal import ImageRef, PixelInput

_TEXT_PREFIX = "language_model."


def text_config(config: Any) -> Any:
    """The decoder's part of an HF config: a vision-language model's `text_config`, else the
    config itself. Vocabulary, context length, KV geometry and token ids come from it."""
    sub = getattr(config, "text_config", None)
    return config if sub is None else sub


def text_decoder(model: nn.Module) -> DecoderForCausalLM:
    """The text decoder of a model: a vision-language model's `language_model`, else itself."""
    decoder = getattr(model, "language_model", model)
    if not isinstance(decoder, DecoderForCausalLM):
        raise ModelLoadError(f"{type(model).__name__} has no DecoderForCausalLM decoder")
    return decoder


class MultimodalCausalLM(CausalLM):
    """A vision encoder plus a text decoder (see the module docstring for the step protocol).

    Parameter tree: `language_model.*` is the decoder (decoder.py's tree); everything else is
    the vision side, named as in the HF checkpoint after its leading `model.` (for example
    `vision_tower.*`, `multi_modal_projector.*`, `visual.*`), so `load_weights` routes by name.

    Under tensor parallelism the decoder is sharded as a text model is; the vision side is
    replicated whole on every rank (each rank runs the same encoder on the same pixels).
    """

    def __init__(self, config: Any, language_model: DecoderForCausalLM, image_token_id: int):
        super().__init__()
        self.config = config
        self.language_model = language_model
        self.image_token_id = int(image_token_id)

    # The decoder's modules, for code that reads a decoder's shape (engine/flops.py).
    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def backend(self) -> Any:
        """The decoder's attention backend (the model runner asks whether it is graph-safe)."""
        return self.language_model.backend

    @abstractmethod
    def encode_images(self, images: Sequence[PixelInput]) -> list[torch.Tensor]:
        """One (num_placeholder_tokens_i, hidden_size) tensor per image, in order, in the
        decoder's dtype. The vision tower runs once for the whole list (batched)."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        """The decoder's token embeddings of `input_ids` (placeholders included: the caller
        overwrites their rows)."""
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64, or (3, T) for M-RoPE models
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # (T, hidden): replaces the embedding lookup
    ) -> torch.Tensor:  # (T, hidden)
        return self.language_model(
            input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds
        )

    def rope_positions(
        self, prompt_token_ids: Sequence[int], images: Sequence[ImageRef]
    ) -> tuple[torch.Tensor | None, int]:
        """M-RoPE models: ((3, len(prompt)) int64 positions of the prompt, delta), where a token
        at sequence index i >= len(prompt) has position i + delta on all three axes
        (transformers' get_rope_index / rope_deltas). 1-D rotary models: (None, 0), positions
        are sequence indices."""
        return None, 0

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, out)

    # ---- weight loading -------------------------------------------------------------------

    def text_weight_name(self, name: str) -> str | None:
        """The decoder's HF name for checkpoint tensor `name` if it belongs to the decoder
        (transformers 5 `model.language_model.*` and `lm_head.*`, transformers 4
        `language_model.model.*` and `language_model.lm_head.*`), else None."""
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        if name.startswith("language_model.model."):
            return name[len("language_model.") :]
        if name.startswith("language_model.lm_head."):
            return name[len("language_model.") :]
        if name.startswith("lm_head."):
            return name
        return None

    def vision_weight_name(self, name: str) -> str | None:
        """Our parameter name for a non-decoder checkpoint tensor (None: not loaded). By
        default the HF name without its leading `model.`; subclasses map renamed or fused
        parameters."""
        return name.removeprefix("model.")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named tensors (see CausalLM): decoder tensors go to `language_model`
        (lazy slices are cut to this rank's shard there), the rest are copied whole."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith(_TEXT_PREFIX)}
        loaded = dict.fromkeys(params, 0)

        def text_weights() -> Iterator[tuple[str, Any]]:
            for hf_name, item in weights:
                text_name = self.text_weight_name(hf_name)
                if text_name is not None:
                    yield text_name, item
                    continue
                name = self.vision_weight_name(hf_name)
                if name is None:
                    continue
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r} matches no model parameter"
                    )
                tensor = take_shard(item, None)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"tensor {hf_name!r}: shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.data.copy_(tensor)
                loaded[name] += tensor.numel()

        self.language_model.load_weights(text_weights())
        missing = [n for n, p in params.items() if loaded[n] != p.numel()]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(
                f"checkpoint lacks weights for {len(missing)} vision parameters: {shown}"
            )

    def param_shard(self, name: str) -> Shard | None:
        """The part of our full parameter `name` this rank holds (None: all; the vision side
        is replicated)."""
        if name.startswith(_TEXT_PREFIX):
            return self.language_model.param_shard(name[len(_TEXT_PREFIX) :])
        return None
