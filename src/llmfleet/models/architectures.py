"""The supported architectures, keyed by the name HF configs put in `architectures`.

Text decoders are defined here. Vision-language models build one of these decoders inside
(`text_model_class`), so they live in their own modules and are imported on first lookup
(`MULTIMODAL_REGISTRY`: name -> (module, class)), which keeps the import graph acyclic.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from llmfleet.models.base import CausalLM
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.layers import MLP
from llmfleet.models.moe import SparseMoE
from llmfleet.shared.core.errors import ModelLoadError


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3 and SmolLM2 (optionally tied embeddings, llama3 rope scaling)."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: bias on the q/k/v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before rotary; head_dim set explicitly."""

    qk_norm = True


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: every layer sparse; softmax over all experts, top-k, renormalized."""

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            renormalize=True,
            tp=self.tp,
        )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: q/k norm; sparse layers every `decoder_sparse_step` except `mlp_only_layers`;
    top-k weights renormalized iff `norm_topk_prob`."""

    qk_norm = True

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_layers = set(getattr(config, "mlp_only_layers", None) or [])
        num_experts = getattr(config, "num_experts", 0) or 0
        if layer_idx not in dense_layers and num_experts > 0 and (layer_idx + 1) % step == 0:
            return SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                num_experts,
                config.num_experts_per_tok,
                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                tp=self.tp,
            )
        return MLP(config.hidden_size, config.intermediate_size, tp=self.tp)


MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    cls.__name__: cls
    for cls in (
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        MixtralForCausalLM,
        Qwen3MoeForCausalLM,
    )
}


# Vision-language models: architecture name -> (module, class), imported on first lookup.
MULTIMODAL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlavaForConditionalGeneration": ("llmfleet.models.llava", "LlavaForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": (
        "llmfleet.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
    ),
}

# The decoder inside a vision-language model, by its text config's `model_type` (sub-configs
# carry no `architectures`).
TEXT_MODEL_TYPES: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def model_class(config: Any) -> type[CausalLM]:
    """The class for an HF config, by its first supported `architectures` entry."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
        if name in MULTIMODAL_REGISTRY:
            module, cls_name = MULTIMODAL_REGISTRY[name]
            cls: type[CausalLM] = getattr(importlib.import_module(module), cls_name)
            return cls
    supported = sorted([*MODEL_REGISTRY, *MULTIMODAL_REGISTRY])
    raise ModelLoadError(
        f"unsupported architecture {names or '(none given in config)'}; "
        f"supported: {', '.join(supported)}"
    )


def text_model_class(text_config: Any) -> type[DecoderForCausalLM]:
    """The decoder class of a vision-language model's text config, by its `model_type`."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in TEXT_MODEL_TYPES:
        raise ModelLoadError(
            f"text model type {model_type!r} of a vision-language model is not supported; "
            f"supported: {', '.join(sorted(TEXT_MODEL_TYPES))}"
        )
    return TEXT_MODEL_TYPES[model_type]
