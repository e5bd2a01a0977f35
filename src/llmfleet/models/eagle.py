"""EAGLE draft heads: small decoders that draft tokens from the target model's hidden states.

Two published checkpoint layouts (config.json in Llama style, weights as safetensors or a
`pytorch_model.bin` state dict; a leading "model." on names is ignored):

EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B)::

    fc.weight (H, 2H), fc.bias (H,) optional      x = fc([embed(token_{t+1}) ; f_t])
    layers.{i}.* (Llama decoder layers)            layer 0 has no input_layernorm
    embed_tokens.weight (V, H) optional            absent: the target's embeddings
    out = x after the layers (residual stream, no final norm); logits = target lm_head(out)

`f_t` is the target's last hidden state after its final norm, at position t; the head's output
at position t predicts f_{t+1}, fed back as the next step's feature.

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)::

    fc.weight (H, 3 H_t)                           g = fc([a_low ; a_mid ; a_high])
    midlayer.input_layernorm.weight (H,)           applied to embed(token_{t+1})
    midlayer.hidden_norm.weight (H,)               applied to g
    midlayer.self_attn.{q,k,v}_proj.weight (., 2H) over [norm(embed) ; norm(g)]
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight,
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight (H,), lm_head.weight (V_d, H)      logits over the draft vocabulary
    d2t (V_d,) int64: target id = draft id + d2t[draft id]; t2d (V,) bool (unused here)
    embed_tokens.weight optional                   absent: the target's embeddings

`a_*` are the target's residual streams entering layers `eagle_aux_hidden_state_layer_ids`
(config, top level or in `eagle_config`; default (2, L // 2, L - 3) for an L-layer target),
i.e. after layers id - 1. The residual is g (or norm(g) with `norm_before_residual`); the
layer's output before `norm` is the next step's feature (no fc).

Both heads attend over their own paged KV cache (same layout as the target's, one cache per
head layer) with the target's attention backend.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.checkpoint_files import iter_safetensors
from llmfleet.models.layers import MLP, Attention, DecoderLayer, Linear, RMSNorm, load_shard
from llmfleet.models.rotary import RotaryEmbedding, rope_parameters
from llmfleet.shared.core.errors import ModelLoadError

_QKV = re.compile(r"(.*self_attn\.)(q_proj|k_proj|v_proj)\.(weight|bias)$")
_GATE_UP = re.compile(r"(.*mlp\.)(gate_proj|up_proj)\.(weight|bias)$")


@dataclass(frozen=True)
class EagleConfig:
    """What a head checkpoint's config.json and tensor names say about it."""

    version: int  # 1 (EAGLE-1) or 3 (EAGLE-3)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int  # EAGLE-3's lm_head rows; EAGLE-1: vocab_size
    target_hidden_size: int  # width of each captured target layer
    rope: dict[str, Any]
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] | None  # EAGLE-3: config's layer ids; None: the default
    fc_bias: bool
    norm_before_residual: bool
    has_embeddings: bool  # the checkpoint carries its own embed_tokens

    def capture_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers (`DecoderForCausalLM.capture_layers`) whose outputs this head
        reads: EAGLE-1 the last; EAGLE-3 the layers before its aux ids."""
        if self.version == 1:
            return (-1,)
        n = target_num_layers
        ids = self.aux_layer_ids or (2, n // 2, n - 3)
        if any(not 1 <= i <= n for i in ids):
            raise ModelLoadError(
                f"EAGLE-3 aux hidden-state layer ids {ids} do not fit a target of {n} layers"
            )
        return tuple(i - 1 for i in ids)


def _tensor_names_and_loader(path: Path) -> tuple[list[str], Any]:
    st = sorted(path.glob("*.safetensors"))
    if st:
        from llmfleet.models.checkpoint_files import safetensors_names

        return safetensors_names(st), lambda: iter_safetensors(st)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"{path} has neither *.safetensors nor pytorch_model*.bin weights")

    def load_bins() -> Any:
        for f in bins:  # weights_only: tensors only, no code from the file runs
            yield from torch.load(f, map_location="cpu", weights_only=True).items()

    names = [n for f in bins for n in torch.load(f, map_location="cpu", weights_only=True)]
    return names, load_bins


def read_eagle_config(path: str | Path) -> tuple[EagleConfig, Any]:
    """The head's config and a callable streaming its (name, tensor) pairs."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    names, stream = _tensor_names_and_loader(path)
    names = [n.removeprefix("model.") for n in names]
    archs = " ".join(raw.get("architectures") or [])
    version = 3 if any(n.startswith("midlayer.") for n in names) or "Eagle3" in archs else 1
    if "fc.weight" not in names:
        raise ModelLoadError(f"{path}: no fc.weight, not an EAGLE head checkpoint")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    eagle = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = int(raw.get("num_hidden_layers", 1))
    if version == 3 and layers != 1:
        raise ModelLoadError(f"{path}: EAGLE-3 heads with {layers} layers are not supported")
    vocab = int(raw["vocab_size"])
    cfg = EagleConfig(
        version=version,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        rope=rope_parameters(_Attrs(raw)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        fc_bias="fc.bias" in names,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        has_embeddings="embed_tokens.weight" in names,
    )
    return cfg, stream


class _Attrs:
    """A config dict read through attributes (what `rope_parameters` expects)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.__dict__.update(raw)


class _Eagle1FirstLayer(nn.Module):
    """EAGLE-1's layer 0: a Llama layer without the input norm (fc's output goes straight in)."""

    def __init__(self, attn: Attention, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x, residual, rope, kv_cache, meta):  # noqa: ANN001 (DecoderLayer's)
        h = self.self_attn(x, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, x)
        return self.mlp(h), residual


class _Eagle3MidLayer(nn.Module):
    """EAGLE-3's single layer: attention over [norm(embed) ; norm(hidden)] (2H wide)."""

    def __init__(self, attn: Attention, mlp: nn.Module, cfg: EagleConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = mlp
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, rope, kv_cache, meta):  # noqa: ANN001
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (T, 2H)
        h = self.self_attn(x, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head (see the module docstring). `forward` maps token
    embeddings and features (T, H) to the next features (T, H); `draft_logits` maps features
    to logits over the target's vocabulary (EAGLE-1: through the target's LM head), `-inf`
    outside an EAGLE-3 head's draft vocabulary."""

    def __init__(self, cfg: EagleConfig, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if cfg.has_embeddings else None
        fc_in = 2 * h if cfg.version == 1 else 3 * cfg.target_hidden_size
        self.fc = Linear(fc_in, h, bias=cfg.fc_bias)
        max_position = max(max_position, cfg.max_position_embeddings)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope)
        layers: list[nn.Module] = []
        for i in range(cfg.num_layers):
            attn = Attention(h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend)
            mlp = MLP(h, cfg.intermediate_size)
            if cfg.version == 3:
                attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=False)
                layers.append(_Eagle3MidLayer(attn, mlp, cfg))
            elif i == 0:
                layers.append(_Eagle1FirstLayer(attn, mlp, h, eps))
            else:
                layers.append(DecoderLayer(attn, mlp, h, eps))
        self.layers = nn.ModuleList(layers)
        if cfg.version == 3:
            self.norm = RMSNorm(h, eps)
            self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's captured layers (T, 3 H_t) -> the first step's feature."""
        return self.fc(target_hidden)

    def forward(
        self,
        embeds: torch.Tensor,  # (T, H)
        features: torch.Tensor,  # (T, H)
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[torch.Tensor],  # one per head layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H): the predicted next features
        rope = self.rotary_emb.at(positions)
        if self.cfg.version == 3:
            h, residual = self.layers[0](embeds, features, rope, kv_caches[0], meta)
            return h + residual
        x = self.fc(torch.cat([embeds, features], dim=-1))  # (T, H)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv, meta)
        return x if residual is None else x + residual

    def draft_logits(self, features: torch.Tensor, target_logits: Any) -> torch.Tensor:
        """(N, V) float32 logits over the target's vocabulary from features (N, H); an
        EAGLE-3 head's tokens outside its draft vocabulary get -inf."""
        if self.cfg.version == 1:
            return target_logits(features)
        draft = self.lm_head(self.norm(features)).float()  # (N, V_d)
        full = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))
        ids = torch.arange(draft.shape[1], device=draft.device)
        full[:, ids + self.d2t] = draft
        return full

    # ---- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> None:
        """Copy a head checkpoint's tensors (HF names) into the fused parameters."""
        params = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if self.cfg.version == 3:
                name = name.replace("midlayer.", "layers.0.")  # our module path
            elif name.endswith("layers.0.input_layernorm.weight"):
                continue  # EAGLE-1's first layer has no input norm
            offset = 0
            if m := _QKV.match(name):
                attn = self.get_submodule(m.group(1).rstrip("."))
                offset = attn.shard_offset(m.group(2))
                name = f"{m.group(1)}qkv_proj.{m.group(3)}"
            elif m := _GATE_UP.match(name):
                mlp = self.get_submodule(m.group(1).rstrip("."))
                offset = mlp.shard_offset(m.group(2))
                name = f"{m.group(1)}gate_up_proj.{m.group(3)}"
            target = params.get(name)
            if target is None:
                raise ModelLoadError(f"EAGLE checkpoint tensor {name!r} matches no parameter")
            try:
                load_shard(target.data, tensor.to(target.dtype), offset)
            except ValueError as exc:
                raise ModelLoadError(f"EAGLE tensor {name!r}: {exc}") from exc
            filled[name] += tensor.numel()
        # Without d2t an EAGLE-3 head drafts over the target's own ids (a full vocabulary).
        optional = {"d2t"} if self.cfg.draft_vocab_size == self.cfg.vocab_size else set()
        missing = [n for n, p in params.items() if filled[n] != p.numel() and n not in optional]
        if missing:
            raise ModelLoadError(f"EAGLE checkpoint lacks {', '.join(sorted(missing)[:5])}")


def load_eagle_head(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: AttentionBackend,
    max_position: int,
) -> EagleHead:
    """An EAGLE head from its checkpoint directory, in `dtype` on `device`."""
    cfg, stream = read_eagle_config(path)
    with torch.device("meta"):
        head = EagleHead(cfg, backend, max_position)
    head = head.to(dtype=dtype).to_empty(device=device)
    head.rotary_emb.rebuild(device)
    if cfg.version == 3:
        head.d2t.zero_()
    with torch.no_grad():
        head.load_weights(stream())
    return head.eval()
