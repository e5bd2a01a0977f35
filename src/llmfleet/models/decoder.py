"""A generic pre-norm decoder-only transformer; the architectures specialize its hooks.

Parameter tree (HF names map onto it in `load_weights`):

    embed_tokens.weight                    (V, hidden)
    layers.{i}.input_layernorm.weight      (hidden,)
    layers.{i}.self_attn.qkv_proj.*        rows [q | k | v]
    layers.{i}.self_attn.{q,k}_norm.weight (head_dim,)   Qwen3 only
    layers.{i}.self_attn.o_proj.*
    layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.gate_up_proj.*          dense: rows [gate | up]
    layers.{i}.mlp.{gate,w13,w2}           sparse: router + stacked experts (see moe.py)
    norm.weight
    lm_head.weight                         absent when embeddings are tied

Under tensor parallelism (`tp`, parallel.py) each rank holds its part of these: the vocabulary
rows `vocab_range` of embed_tokens / lm_head, its heads' rows of qkv_proj (rows [q | k | v] of
its own heads) and columns of o_proj, its intermediate rows of gate_up_proj / w13 and columns
of down_proj / w2; norms, rotary and MoE routers are whole on every rank. `weight_shard` says
which part of an HF tensor a rank loads, `param_shard` which part of a full parameter.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.attention.reference import TorchReferenceBackend
from llmfleet.models.base import CausalLM
from llmfleet.models.int4_linear import (
    Int4Linear,
    PackedInt4,
    unloaded_int4_linears,
)
from llmfleet.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    Linear,
    RMSNorm,
    VocabParallelEmbedding,
    linear,
    load_shard,
    summed_norm,
)
from llmfleet.models.moe import SparseMoE
from llmfleet.models.parallel import SINGLE, Shard, TensorParallel, split_evenly, take_shard
from llmfleet.models.rotary import (
    RotaryEmbedding,
    rope_parameters,
)
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_QKV = re.compile(r"self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$")
_GATE_UP = re.compile(r"mlp\.(gate_proj|up_proj)\.(weight|bias)$")
# Per-expert HF names: Qwen3-MoE `mlp.experts.{e}.gate_proj`,
# Mixtral `block_sparse_moe.experts.{e}.w1` (w1 gate, w3 up, w2 down).
_EXPERT = re.compile(
    r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# transformers-5 native layout: experts already stacked.
_STACKED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
_SKIPPED = ("rotary_emb.inv_freq",)


def _scaled(r: range, n: int) -> range:
    return range(r.start * n, r.stop * n)


def _shifted(r: range, n: int) -> range:
    return range(r.start + n, r.stop + n)


def kv_geometry(config: Any) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of an HF decoder config."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_heads


class DecoderForCausalLM(CausalLM):
    """Llama-style decoder. Subclasses override `qkv_bias`, `qk_norm` and `make_mlp`."""

    qkv_bias = False
    qk_norm = False
    # Hidden-state capture for speculative decoding (EAGLE): decoder layers whose output the
    # next `forward` keeps in `aux_hidden` (negative: from the end; -1: after the last layer,
    # before the final norm). () keeps nothing.
    capture_layers: tuple[int, ...] = ()

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.aux_hidden: torch.Tensor | None = None  # what `capture_layers` kept last forward
        self.backend = backend if backend is not None else TorchReferenceBackend()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads, self.head_dim = kv_geometry(config)
        self.num_kv_heads = num_kv_heads
        eps = config.rms_norm_eps
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        params = rope_parameters(config)
        rotary_dim = int(self.head_dim * float(params.get("partial_rotary_factor", 1.0)))

        vocab = int(config.vocab_size)
        if vocab < tp.size:
            raise ValueError(f"a vocabulary of {vocab} cannot be split over {tp.size} ranks")
        self.vocab_range = split_evenly(vocab, tp.size, tp.rank)
        self.embed_tokens: nn.Module = (
            nn.Embedding(vocab, hidden)
            if tp.size == 1
            else VocabParallelEmbedding(self.vocab_range, hidden, tp)
        )
        self.rotary_emb = RotaryEmbedding(rotary_dim, config.max_position_embeddings, params)
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            attn = Attention(
                hidden,
                num_heads,
                num_kv_heads,
                self.head_dim,
                self.backend,
                qkv_bias=self.qkv_bias or bool(getattr(config, "attention_bias", False)),
                o_bias=bool(getattr(config, "attention_bias", False)),
                qk_norm_eps=eps if self.qk_norm else None,
                tp=tp,
            )
            self.layers.append(DecoderLayer(attn, self.make_mlp(config, i), hidden, eps))
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(hidden, len(self.vocab_range), bias=False)
        )

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        bias = getattr(config, "mlp_bias", False)
        return MLP(config.hidden_size, config.intermediate_size, bias, tp=self.tp)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # (T, hidden): replaces the embedding lookup
    ) -> torch.Tensor:  # (T, hidden)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} KV caches, got {len(kv_caches)}")
        pending: TensorParallel | None = None  # h is a part, to be summed over this group
        if inputs_embeds is not None:
            h = inputs_embeds  # (T, hidden)
        elif isinstance(self.embed_tokens, VocabParallelEmbedding):  # summed with the 1st norm
            h, pending = self.embed_tokens(input_ids, reduce=False), self.embed_tokens.tp
        else:
            h = self.embed_tokens(input_ids)
        rope = self.rotary_emb.at(positions)
        residual: torch.Tensor | None = None
        wanted = self._captured_layers()
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            defer = None if i in wanted else layer.deferrable()
            h, residual = layer(h, residual, rope, kv_cache, meta, pending, defer is not None)
            pending = defer
            if i in wanted:  # the residual stream after layer i, (T, hidden)
                captured[i] = h + residual
        self.aux_hidden = (
            torch.cat([captured[i] for i in wanted], dim=-1) if wanted else None
        )  # (T, hidden * len(capture_layers)), in the listed order
        h, _ = summed_norm(self.norm, h, residual, pending)
        return h

    def _captured_layers(self) -> list[int]:
        """`capture_layers` as layer indices in [0, num_layers), in the listed order."""
        n = len(self.layers)
        out = []
        for i in self.capture_layers:
            if not -n <= i < n:
                raise ValueError(f"capture layer {i} is outside the model's {n} layers")
            out.append(i % n)
        return out

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # (N, hidden) -> (N, V) float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp.size > 1:
            return self._gathered_logits(hidden, weight, out)
        if out is None and hidden.dtype == torch.float32:
            return linear(hidden, weight)
        if out is None:
            out = hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
        return linear(hidden, weight, out=out)  # decode sizes: written by the GEMV / GEMM

    def _gathered_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:  # (N, hidden) -> (N, V) float32 on every rank
        n, vocab, size = hidden.shape[0], int(self.config.vocab_size), self.tp.size
        width = -(-vocab // size)  # all_gather needs one shape: pad each rank's columns to it
        if n == 1 and out is not None and width * size == vocab and out.is_contiguous():
            # One row: the ranks' columns lie in `out` in rank order, so this rank's land in
            # its place and the gather runs in place, with no copy after it.
            ranks = out.view(size, 1, width)
            linear(hidden, weight, out=ranks[self.tp.rank])
            self.tp.all_gather_into(ranks)
            return out
        if hidden.dtype == torch.float32:
            local = linear(hidden, weight)  # (N, V_rank)
        else:
            local = linear(
                hidden, weight, out=hidden.new_empty((n, weight.shape[0]), dtype=torch.float32)
            )
        if local.shape[1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        full = self.tp.all_gather(local, dim=1)  # (N, size * width)
        if width * size != vocab:
            parts = [split_evenly(vocab, size, r) for r in range(size)]
            full = torch.cat(
                [full[:, r * width : r * width + len(p)] for r, p in enumerate(parts)], 1
            )
        return full if out is None else out.copy_(full)

    # ---- weight loading -------------------------------------------------------------------

    def weight_target(self, name: str) -> tuple[str, int | None, int] | None:
        """Where `load_weights` puts the checkpoint tensor of HF name `name`: (our parameter
        name, expert index or None, row offset), or None when it is not loaded."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.endswith(_SKIPPED) or (name == "lm_head.weight" and self.lm_head is None):
            return None
        m = _LAYER.match(name)
        if m is None:
            return name, None, 0
        i, rest = int(m.group(1)), m.group(2)
        prefix = f"layers.{i}."
        layer = self.layers[i] if i < len(self.layers) else None
        if layer is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} is for a layer the config lacks")
        if m2 := _QKV.match(rest):
            offset = layer.self_attn.shard_offset(m2.group(1))
            return f"{prefix}self_attn.qkv_proj.{m2.group(2)}", None, offset
        if isinstance(layer.mlp, MLP) and (m2 := _GATE_UP.match(rest)):
            offset = layer.mlp.shard_offset(m2.group(1))
            return f"{prefix}mlp.gate_up_proj.{m2.group(2)}", None, offset
        if isinstance(layer.mlp, SparseMoE):
            inter = layer.mlp.intermediate_size
            if m2 := _EXPERT.match(rest):
                expert, proj = int(m2.group(1)), m2.group(2)
                if proj in ("down_proj", "w2"):
                    return f"{prefix}mlp.w2", expert, 0
                offset = 0 if proj in ("gate_proj", "w1") else inter
                return f"{prefix}mlp.w13", expert, offset
            if m2 := _STACKED.match(rest):
                return f"{prefix}mlp.{'w13' if m2.group(1) == 'gate_up_proj' else 'w2'}", None, 0
            if rest == "block_sparse_moe.gate.weight":
                return f"{prefix}mlp.gate.weight", None, 0
        return name, None, 0

    def weight_shard(self, name: str) -> Shard | None:
        """The part of HF tensor `name` (HF layout, (out, in) weights) that this rank loads;
        None: all of it (always so at tensor-parallel size 1)."""
        if self.tp.size == 1:
            return None
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, (self.vocab_range,)
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return None
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        attn, mlp = layer.self_attn, layer.mlp
        if m2 := _QKV.match(rest):
            heads = attn.q_heads if m2.group(1) == "q_proj" else attn.kv_heads
            return 0, (_scaled(heads, attn.head_dim),)
        if rest == "self_attn.o_proj.weight":
            return 1, (_scaled(attn.q_heads, attn.head_dim),)
        if isinstance(mlp, MLP) and _GATE_UP.match(rest):
            return 0, (mlp.intermediate_range,)
        if isinstance(mlp, MLP) and rest == "mlp.down_proj.weight":
            return 1, (mlp.intermediate_range,)
        if isinstance(mlp, SparseMoE):
            inter = mlp.intermediate_range
            if m2 := _EXPERT.match(rest):
                return (1, (inter,)) if m2.group(2) in ("down_proj", "w2") else (0, (inter,))
            if m2 := _STACKED.match(rest):  # (E, 2I, hidden) [gate | up] or (E, hidden, I)
                if m2.group(1) == "down_proj":
                    return 2, (inter,)
                return 1, (inter, _shifted(inter, mlp.full_intermediate_size))
        return None

    def param_shard(self, name: str) -> Shard | None:
        """The part of our full (unsplit) parameter `name` that this rank holds; None: all."""
        if self.tp.size == 1:
            return None
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, (self.vocab_range,)
        m = _LAYER.match(name)
        if m is None:
            return None
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        attn, mlp = layer.self_attn, layer.mlp
        if rest.startswith("self_attn.qkv_proj."):  # rows [q | k | v] of all heads
            d = attn.head_dim
            q_size, kv_size = attn.total_num_heads * d, attn.total_num_kv_heads * d
            kv = _scaled(attn.kv_heads, d)
            return 0, (
                _scaled(attn.q_heads, d),
                _shifted(kv, q_size),
                _shifted(kv, q_size + kv_size),
            )
        if rest == "self_attn.o_proj.weight":
            return 1, (_scaled(attn.q_heads, attn.head_dim),)
        if rest.startswith("mlp.gate_up_proj.") or rest == "mlp.w13":
            inter = mlp.intermediate_range
            return int(rest == "mlp.w13"), (inter, _shifted(inter, mlp.full_intermediate_size))
        if rest == "mlp.down_proj.weight":
            return 1, (mlp.intermediate_range,)
        if rest == "mlp.w2":
            return 2, (mlp.intermediate_range,)
        return None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named tensors (see CausalLM). Under tensor parallelism a tensor may also be
        a lazy safetensors slice: only this rank's part (`weight_shard`) is read."""
        params = dict(self.named_parameters())
        numel_loaded = dict.fromkeys(params, 0)
        for hf_name, item in weights:
            route = self.weight_target(hf_name)
            if route is None:
                continue
            name, expert, offset = route
            if isinstance(item, PackedInt4):  # into an Int4Linear, still packed
                self._load_packed(hf_name, name, item.shard(self.weight_shard(hf_name)), offset)
                continue
            tensor = take_shard(item, self.weight_shard(hf_name))
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} matches no model parameter")
            target = param.data if expert is None else param.data[expert]
            try:
                if offset == 0 and tuple(tensor.shape) == tuple(target.shape):
                    with torch.no_grad():
                        target.copy_(tensor)
                else:
                    load_shard(target, tensor, offset)
            except ValueError as exc:
                raise ModelLoadError(f"tensor {hf_name!r}: {exc}") from exc
            numel_loaded[name] += tensor.numel()
        missing = [n for n, p in params.items() if numel_loaded[n] != p.numel()]
        missing += [f"{m}.weight" for m in unloaded_int4_linears(self)]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks weights for {len(missing)} parameters: {shown}")

    def _load_packed(self, hf_name: str, name: str, packed: PackedInt4, offset: int) -> None:
        module_name = name.removesuffix(".weight")
        module = self.get_submodule(module_name) if name.endswith(".weight") else None
        if not isinstance(module, Int4Linear):
            raise ModelLoadError(f"packed checkpoint tensor {hf_name!r}: {name} is not INT4")
        try:
            module.load_shard(packed, offset)
        except ValueError as exc:
            raise ModelLoadError(f"tensor {hf_name!r}: {exc}") from exc
