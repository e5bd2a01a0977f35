"""The pre-norm ViT encoder shared by CLIP and SigLIP vision towers, in HF's parameter names:

    layers.{i}.layer_norm1.{weight,bias}
    layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}
    layers.{i}.layer_norm2.{weight,bias}
    layers.{i}.mlp.fc{1,2}.{weight,bias}

Images are a batch of equal-length patch sequences (B, N, D): no padding, no mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmfleet.shared.core.errors import ModelLoadError


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation an HF config names (`hidden_act`, `projector_hidden_act`)."""
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"activation {name!r} is not supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def hidden_state_index(layer: int, num_layers: int) -> int:
    """HF's `hidden_states[layer]` index (0: the embeddings, i: after encoder layer i; negative
    counts from the end) as a non-negative one; ModelLoadError when out of range."""
    index = layer + num_layers + 1 if layer < 0 else layer
    if not 0 <= index <= num_layers:
        raise ModelLoadError(f"vision feature layer {layer} of a {num_layers}-layer encoder")
    return index


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ModelLoadError(f"vision hidden size {hidden} is not a multiple of {num_heads}")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        b, n, d = x.shape
        heads = (b, n, self.num_heads, d // self.num_heads)
        q = self.q_proj(x).view(heads).transpose(1, 2)  # (B, H, N, hd)
        k = self.k_proj(x).view(heads).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(d // self.num_heads))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, act: str, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The first `num_layers` encoder layers of an HF CLIP/SigLIP vision config (a tower whose
    features come from an earlier layer never runs, or loads, the later ones)."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        c = config
        self.layers = nn.ModuleList(
            VisionEncoderLayer(
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.hidden_act,
                c.layer_norm_eps,
            )
            for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor, indices: Sequence[int]) -> list[torch.Tensor]:
        """The hidden states at `indices` (0: `x` itself, i: after layer i), in that order."""
        wanted = set(indices)
        states = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers, 1):
            x = layer(x)
            if i in wanted:
                states[i] = x
        return [states[i] for i in indices]
