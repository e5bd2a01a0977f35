"""Rotary position embedding (RoPE), neox / half-rotation style as HF Llama uses it.

A head vector x of size D is split into halves (x1, x2) = (x[:D/2], x[D/2:]) and rotated as
(x1 * cos - x2 * sin, x2 * cos + x1 * sin) with angle position * inv_freq[j] for pair j.
Frequencies follow `rope_type` "default", "linear" or "llama3" (Llama 3.1 wavelength-dependent
scaling). cos/sin are tabulated once for every position up to `max_position`.

M-RoPE (Qwen2-VL; rope parameters with `mrope_section` [s_t, s_h, s_w] summing to D/2): a
token has three positions (t, h, w); pair j takes its angle from the t position for
j < s_t, from h for the next s_h pairs, from w for the last s_w. Given (3, T) positions, `at`
gathers each token's cos/sin row from the three axes' rows into a per-pass table of T rows
and rotates with positions 0..T-1 into it, so every rotation kernel serves it unchanged. (T,)
positions mean the same position on all three axes, which is plain 1-D rotary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmfleet.shared.core.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with at least rope_type and rope_theta.

    transformers 5 keeps them in `config.rope_parameters`; older configs use `rope_theta` plus
    an optional `rope_scaling` dict (whose type key may be spelled "type").
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def compute_inv_freq(
    rotary_dim: int, params: dict[str, Any], device: torch.device | None = None
) -> torch.Tensor:  # (rotary_dim/2,) float32
    base = float(params["rope_theta"])
    exponents = (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    )
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (> old_len / low) are slowed by `factor`, short ones (< old_len / high)
        # kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables (float32) and their application to q and k.

    The table is a plain attribute, not a buffer, so `model.to(dtype)` never rounds it; it
    follows the device of the positions it is asked for (rebuilt once on a device change, e.g.
    after a model built on the meta device is materialized).
    """

    def __init__(self, rotary_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ModelLoadError(f"rotary dimension must be even, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.params = dict(params)
        # Follows the default device, so building under `torch.device("meta")` costs nothing.
        self.cos_sin = self._table(None)
        self.mrope_section: tuple[int, ...] | None = None
        if params.get("mrope_section"):
            self.mrope_section = tuple(int(s) for s in params["mrope_section"])
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != rotary_dim // 2:
                raise ModelLoadError(
                    f"mrope_section {list(self.mrope_section)} must be 3 sizes summing to "
                    f"{rotary_dim // 2}, half the rotary dimension"
                )
            # Which axis (0 t, 1 h, 2 w) each [cos | sin] column of the table is taken from
            # (on the CPU even while a model is built on the meta device).
            cpu = torch.device("cpu")
            sizes = torch.tensor(self.mrope_section, device=cpu)
            axis = torch.repeat_interleave(torch.arange(3, device=cpu), sizes)
            self._mrope_axis = torch.cat([axis, axis])  # (rotary_dim,) int64

    def _table(self, device: torch.device | None) -> torch.Tensor:  # (max_position, rotary_dim)
        inv_freq = compute_inv_freq(self.rotary_dim, self.params, device)
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (P, rotary_dim/2)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def rebuild(self, device: torch.device | str) -> None:
        """Recompute the table (float32) on `device`."""
        self.cos_sin = self._table(torch.device(device))

    def at(self, positions: torch.Tensor) -> RotaryPositions:
        """The rotary inputs of one forward pass over tokens at `positions`: (T,) int64, or
        (3, T) int64 (t, h, w) positions for M-RoPE."""
        if self.cos_sin.device != positions.device:
            self.rebuild(positions.device)
        if positions.dim() == 1:
            return RotaryPositions(positions, self.cos_sin)
        return self._mrope_at(positions)

    def _mrope_at(self, positions: torch.Tensor) -> RotaryPositions:  # positions (3, T)
        if self.mrope_section is None or positions.shape[0] != 3:
            raise ValueError(
                f"positions of shape {tuple(positions.shape)} need M-RoPE (3, T); this "
                f"rotary has mrope_section {self.mrope_section}"
            )
        t, r = positions.shape[1], self.rotary_dim
        if self._mrope_axis.device != positions.device:
            self._mrope_axis = self._mrope_axis.to(positions.device)
        rows = self.cos_sin.index_select(0, positions.reshape(-1)).view(3, t, r)
        table = rows.gather(0, self._mrope_axis.view(1, 1, r).expand(1, t, r))[0]  # (T, r)
        return RotaryPositions(torch.arange(t, device=positions.device), table)


class RotaryPositions:
    """Positions of one forward pass and the [cos | sin] table; `rotate_qk` applies them.

    On CUDA the Triton kernel rotates q and k in place, straight from the table (one launch
    per layer, computed in float32). Elsewhere the reference gathers cos/sin once per pass
    and rotates out of place in the activations' dtype, as transformers does. An attention
    backend given these (`AttentionBackend.forward(..., rope=)`) may instead rotate with its
    own kernel, from `positions` and `table`.
    """

    def __init__(self, positions: torch.Tensor, table: torch.Tensor) -> None:
        self.positions = positions  # (T,) int64
        self.table = table  # (max_position, rotary_dim) float32
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at the positions, each (T, 1, rotary_dim/2) float32 (gathered once)."""
        if self._cos_sin is None:
            cs = self.table.index_select(0, self.positions)  # (T, rotary_dim)
            cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)
            self._cos_sin = (cos, sin)
        return self._cos_sin

    def rotate_qk(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, Hkv, D)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q (T, H, D), k (T, Hkv, D)
        """Rotate q and k; in place on CUDA (unit stride in D), else new tensors."""
        if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

            dispatch.rotary_embedding(self.positions, q, k, self.table)
            return q, k
        cos, sin = self.cos_sin()
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def rotate(
        self, qk: torch.Tensor, num_q_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (T, H + Hkv, D) -> q (T, H, D), k (T, Hkv, D)
        """Rotate q and k, laid out as one tensor of heads [q | k]; in place on CUDA."""
        q, k = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
        return self.rotate_qk(q, k)


def apply_rotary(
    x: torch.Tensor,  # (T, heads, D)
    cos: torch.Tensor,  # (T, 1, R/2) float32
    sin: torch.Tensor,  # (T, 1, R/2) float32
) -> torch.Tensor:  # (T, heads, D)
    r = cos.shape[-1] * 2
    rot, rest = x[..., :r], x[..., r:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rest.shape[-1]:
        out = torch.cat([out, rest], dim=-1)
    return out
