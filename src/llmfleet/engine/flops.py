"""Estimated work of one engine step: FLOPs, bytes read and bytes written, from the model's
shape and the step's batch. Counted per worker, these give model FLOPs utilization (FLOPs/s over
the device's peak) and bandwidth use (bytes/s over its peak) without profiling.

What is counted, per step (L layers, h hidden, q = heads*head_dim, kv = kv_heads*head_dim,
T new tokens in all, sequence i computing n_i new tokens after c_i already-computed ones):

    FLOPs   2 per multiply-add of every matmul a token goes through:
              projections  2*T*L*(h*(q + 2*kv) + q*h)
              dense MLP    2*T*L_dense*3*h*I                     (gate, up, down)
              sparse MLP   2*T*L_moe*(h*E + k*3*h*I_moe)         (router + k experts)
              attention    4*L*q * sum_i(n_i*c_i + n_i*(n_i+1)/2)
                           (QK^T and PV; token j of a chunk sees c_i + j + 1 keys)
              LM head      2*h*V per sampled row (only those rows reach it)
    read    every layer weight once (a MoE layer: the router and at most min(E, T*k)
            experts), the LM head when a row is sampled, T embedding rows, and each
            sequence's whole KV context once per layer: (c_i + n_i) tokens. Weights count
            in the bytes they are stored in: FP8 or packed INT4 projections (with their
            scales and biases) read less than the embedding's dtype would say
    written the new tokens' K and V: T tokens per layer

Norms, biases, rotary embedding, softmax and activations are left out: they are a small
fraction of both FLOPs and bytes at these shapes, and no kernel is assumed to fuse or not.
The estimate is of the model's work, not of this implementation's (a CPU reference path that
re-reads KV moves more bytes than counted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.models.layers import MLP, Attention
from llmfleet.models.moe import SparseMoE


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimate needs. Sparse layers are the `num_moe_layers` of `num_layers`
    whose MLP is a mixture of `num_experts` experts of width `moe_intermediate_size`, each
    token routed to `experts_per_token`; the other layers have a dense MLP of width
    `intermediate_size`."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    weight_bytes: int  # bytes per weight element of the embedding, LM head and router
    kv_bytes: int  # bytes per KV-cache element
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Bytes per weight of the layers' attention projections, dense MLPs and experts, as
    # stored (FP8 or packed INT4 with their scales: fractions of the embedding's); None:
    # weight_bytes.
    projection_weight_bytes: float | None = None
    mlp_weight_bytes: float | None = None
    expert_weight_bytes: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(
                f"num_moe_layers must be in [0, num_layers={self.num_layers}], "
                f"got {self.num_moe_layers}"
            )
        if self.num_moe_layers and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in [1, num_experts={self.num_experts}], "
                f"got {self.experts_per_token}"
            )

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def projection_params(self) -> int:
        """Weights of one layer's q/k/v and output projections."""
        q, kv, h = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.hidden_size,
        )
        return h * (q + 2 * kv) + q * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class StepBatch:
    """One step's batch: for each scheduled sequence, the tokens it computes now and the
    tokens it had computed before; and how many rows are sampled (go through the LM head)."""

    num_new_tokens: Sequence[int]
    num_context_tokens: Sequence[int]
    num_sampled: int

    def __post_init__(self) -> None:
        if len(self.num_new_tokens) != len(self.num_context_tokens):
            raise ValueError(
                f"num_new_tokens has {len(self.num_new_tokens)} entries, "
                f"num_context_tokens {len(self.num_context_tokens)}"
            )

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepBatch:
        """The batch of a scheduler output, read before the step advances the requests."""
        return cls(
            tuple(s.num_new_tokens for s in sched.scheduled),
            tuple(s.request.num_computed_tokens for s in sched.scheduled),
            sum(1 + len(s.spec_token_ids) for s in sched.scheduled if s.samples),
        )


def step_work(sched: SchedulerOutput) -> tuple[int, int]:
    """(prompt tokens computed, sequences decoded) by a step, read before it advances them."""
    prompt = [
        s.num_new_tokens
        for s in sched.scheduled
        if s.request.num_computed_tokens < s.request.num_prompt_tokens
    ]
    return sum(prompt), len(sched.scheduled) - len(prompt)


@dataclass(frozen=True)
class StepCost:
    flops: int = 0
    read_bytes: int = 0
    write_bytes: int = 0

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(
            self.flops + other.flops,
            self.read_bytes + other.read_bytes,
            self.write_bytes + other.write_bytes,
        )


def estimate_step_cost(shape: ModelShape, batch: StepBatch) -> StepCost:
    """FLOPs and bytes of one step (see the module docstring for what is counted)."""
    s = shape
    h, q, L = s.hidden_size, s.num_heads * s.head_dim, s.num_layers
    T = sum(batch.num_new_tokens)
    if T == 0:
        return StepCost()
    router = h * s.num_experts
    per_token_params = (
        L * s.projection_params
        + s.num_dense_layers * 3 * h * s.intermediate_size
        + s.num_moe_layers * (router + s.experts_per_token * s.expert_params)
    )
    attended = sum(
        n * c + n * (n + 1) // 2
        for n, c in zip(batch.num_new_tokens, batch.num_context_tokens, strict=True)
    )
    flops = (
        2 * T * per_token_params + 4 * L * q * attended + 2 * h * s.vocab_size * batch.num_sampled
    )

    experts_read = min(s.num_experts, T * s.experts_per_token)
    plain = s.weight_bytes
    weight_bytes = (
        L * s.projection_params * _or(s.projection_weight_bytes, plain)
        + s.num_dense_layers * 3 * h * s.intermediate_size * _or(s.mlp_weight_bytes, plain)
        + s.num_moe_layers * experts_read * s.expert_params * _or(s.expert_weight_bytes, plain)
        + (s.num_moe_layers * router + T * h + (h * s.vocab_size if batch.num_sampled else 0))
        * plain  # routers, embedding rows, LM head
    )
    kv_tokens_read = sum(batch.num_context_tokens) + T
    return StepCost(
        flops=flops,
        read_bytes=round(weight_bytes) + kv_tokens_read * s.kv_bytes_per_token,
        write_bytes=T * s.kv_bytes_per_token,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _stored_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _module_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the modules' weights as stored: parameters and buffers (packed words, scales,
    zero points) other than biases, which the estimate leaves out."""
    return _stored_bytes(
        t
        for m in modules
        for name, t in (*m.named_parameters(), *m.named_buffers())
        if not name.endswith("bias")
    )


def model_shape(model: nn.Module, kv_bytes: int) -> ModelShape:
    """The shape of a `DecoderForCausalLM` (read from its modules, so it is what runs: under
    tensor parallelism this rank's shard), with the bytes per weight its projections, MLPs and
    experts are stored in."""
    embed = getattr(getattr(model, "embed_tokens", None), "weight", None)  # (vocab, hidden)
    layers = getattr(model, "layers", None)
    if not isinstance(embed, torch.Tensor) or not isinstance(layers, nn.ModuleList) or not layers:
        raise TypeError(f"{type(model).__name__} is not a decoder with embed_tokens and layers")
    attn = layers[0].self_attn
    if not isinstance(attn, Attention):
        raise TypeError(f"unknown attention module {type(attn).__name__}")
    dense = [layer.mlp for layer in layers if isinstance(layer.mlp, MLP)]
    sparse = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]
    if len(dense) + len(sparse) != len(layers):
        raise TypeError("a layer's MLP is neither MLP nor SparseMoE")
    attns = [layer.self_attn for layer in layers]
    proj = _module_bytes(m for a in attns for m in (a.qkv_proj, a.o_proj))
    shape = ModelShape(
        num_layers=len(layers),
        hidden_size=embed.shape[1],
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        vocab_size=embed.shape[0],
        intermediate_size=dense[0].intermediate_size if dense else 0,
        weight_bytes=embed.element_size(),
        kv_bytes=kv_bytes,
        num_moe_layers=len(sparse),
        num_experts=sparse[0].num_experts if sparse else 0,
        experts_per_token=sparse[0].top_k if sparse else 0,
        moe_intermediate_size=sparse[0].intermediate_size if sparse else 0,
    )
    experts = _stored_bytes(t for moe in sparse for t in (moe.w13, moe.w2))
    return dataclasses.replace(
        shape,
        projection_weight_bytes=proj / (len(layers) * shape.projection_params),
        mlp_weight_bytes=(
            _module_bytes(dense) / (len(dense) * 3 * shape.hidden_size * shape.intermediate_size)
            if dense
            else None
        ),
        expert_weight_bytes=(
            experts / (len(sparse) * shape.num_experts * shape.expert_params) if sparse else None
        ),
    )
