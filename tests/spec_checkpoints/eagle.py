"""Random-weight EAGLE heads in the layouts their authors publish, for tiny_models' targets.

EAGLE-1 (as yuhuili/EAGLE-LLaMA3-Instruct-8B): a Llama `config.json` with one hidden layer and
`pytorch_model.bin` holding `fc.weight` (H, 2H), `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj`,
`layers.0.post_attention_layernorm`, `layers.0.mlp.{gate,up,down}_proj` (no input norm in
layer 0), optionally `embed_tokens.weight`.

EAGLE-3 (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `config.json` with `draft_vocab_size` and
`model.safetensors` holding `fc.weight` (H, 3H), `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v}_proj.weight` (., 2H),
`midlayer.self_attn.o_proj.weight`, `midlayer.mlp.*`, `norm.weight`, `lm_head.weight`
(V_d, H), `d2t` (V_d,) int64 with target id = draft id + d2t[draft id], `t2d` (V,) bool.

`read_tensors(dir)` returns what a writer saved, for references computed from the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tiny_models import _COMMON, VOCAB

HIDDEN = _COMMON["hidden_size"]
HEADS = _COMMON["num_attention_heads"]
KV_HEADS = _COMMON["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS
INTER = _COMMON["intermediate_size"]
EPS = 1e-5
THETA = 10000.0


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        **extra,
    }


def _layer(g: torch.Generator, prefix: str, attn_in: int, std: float) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)

    return {
        f"{prefix}self_attn.q_proj.weight": w(HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}post_attention_layernorm.weight": norm(),
        f"{prefix}mlp.gate_proj.weight": w(INTER, HIDDEN),
        f"{prefix}mlp.up_proj.weight": w(INTER, HIDDEN),
        f"{prefix}mlp.down_proj.weight": w(HIDDEN, INTER),
    }


def write_eagle1(out: Path, *, seed: int = 0, embeddings: bool = False, std: float = 0.1) -> Path:
    """An EAGLE-1 head for a tiny_models target in `out` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = _layer(g, "layers.0.", HIDDEN, std)
    tensors["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * std
    tensors["fc.bias"] = torch.randn(HIDDEN, generator=g) * std
    if embeddings:
        tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=g)
    (out / "config.json").write_text(json.dumps(_config(bias=True)))
    torch.save(tensors, out / "pytorch_model.bin")
    return out


def write_eagle3(
    out: Path,
    *,
    seed: int = 0,
    draft_vocab: int = 200,
    aux_layer_ids: list[int] | None = None,
    std: float = 0.1,
) -> Path:
    """An EAGLE-3 head for a tiny_models target in `out` (created); `aux_layer_ids` goes into
    config.json's `eagle_config` when given (else readers take the default ids)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = _layer(g, "midlayer.", 2 * HIDDEN, std)
    tensors["midlayer.input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)
    tensors["midlayer.hidden_norm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)
    tensors["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=g) * std
    tensors["norm.weight"] = 1.0 + 0.1 * torch.randn(HIDDEN, generator=g)
    tensors["lm_head.weight"] = torch.randn(draft_vocab, HIDDEN, generator=g)
    used = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values  # draft -> target ids
    tensors["d2t"] = used - torch.arange(draft_vocab)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    tensors["t2d"] = t2d
    extra: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": draft_vocab,
    }
    if aux_layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (out / "config.json").write_text(json.dumps(_config(**extra)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors a writer saved in `path`."""
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    return torch.load(path / "pytorch_model.bin", weights_only=True)
