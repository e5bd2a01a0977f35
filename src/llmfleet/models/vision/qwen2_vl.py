"""The Qwen2-VL vision transformer: patch embedding, blocks with 2-D rotary attention that
never crosses images, and the patch merger into the text hidden size.

Input layout (Qwen2VLImageProcessor's `pixel_values`): one row per patch, (N, C*T*P*P) with
C channels, T temporal patch (a still image is repeated T times), P x P pixels, flattened in
(C, T, P, P) order. An image of grid (t, h, w) patches has t*h*w rows, in merge-block-major
order: the m x m patches that the merger fuses into one token are consecutive rows

    row = ((ti * h/m + bi) * w/m + bj) * m*m + (i * m + j)     for patch (ti, bi*m + i, bj*m + j)

so the merger is a reshape of m*m consecutive rows and image k's tokens are t*h*w / m^2
consecutive rows of the output. Attention runs per frame of each image (cu_seqlens); frames
of equal length run as one batched call.

Parameter names are transformers' (below `visual.`): patch_embed.proj.weight (E, C, T, P, P),
blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.fc1,mlp.fc2}, merger.{ln_q,mlp.0,mlp.2}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmfleet.models.rotary import apply_rotary
from llmfleet.shared.core.errors import ModelLoadError

Grid = tuple[int, int, int]  # (t, h, w) patches


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class PatchEmbed(nn.Module):
    """A Conv3d with stride = kernel over (C, T, P, P) patches, i.e. one matmul per row."""

    def __init__(self, in_channels: int, temporal: int, patch: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, in_channels, temporal, patch, patch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C*T*P*P) -> (N, E)
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,  # (N, E)
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each (N, 1, head_dim/2) float32
        segments: list[tuple[int, list[int]]],  # (length, start rows) of equal-length frames
    ) -> torch.Tensor:  # (N, E)
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, D)
        cos, sin = cos_sin
        # Rotated in float32, as transformers does.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        if len(segments) == 1 and segments[0][0] * len(segments[0][1]) == n:
            # Every frame has one length (the usual batch): a view, no gather.
            length = segments[0][0]
            qs, ks, vs = (
                t.view(n // length, length, self.num_heads, self.head_dim) for t in (q, k, v)
            )
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            )  # (B, H, L, D)
            return self.proj(o.transpose(1, 2).reshape(n, -1))
        out = torch.empty_like(q)  # (N, H, D)
        for length, starts in segments:
            idx = _segment_rows(starts, length, x.device)  # (B * L,)
            qs, ks, vs = (
                t.index_select(0, idx).view(len(starts), length, self.num_heads, self.head_dim)
                for t in (q, k, v)
            )
            o = F.scaled_dot_product_attention(  # (B, H, L, D), no mask: within one frame
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            )
            out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim))
        return self.proj(out.view(n, -1))


def _segment_rows(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    base = torch.tensor(starts, device=device).unsqueeze(1)  # (B, 1)
    return (base + torch.arange(length, device=device)).reshape(-1)


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: Callable) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMlp(dim, mlp_hidden, act)

    def forward(self, x: torch.Tensor, cos_sin: Any, segments: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then m*m consecutive patches concatenated and projected to `out_dim`."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, E) -> (N / m^2, out_dim)
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Stateless over calls: `forward(pixels, grids)` encodes a batch of images at once."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, heads = int(config.embed_dim), int(config.num_heads)
        self.embed_dim, self.num_heads = dim, heads
        self.patch, self.temporal = int(config.patch_size), int(config.temporal_patch_size)
        self.in_channels = int(
            getattr(config, "in_channels", None) or getattr(config, "in_chans", 3)
        )
        self.merge = int(config.spatial_merge_size)
        act_name = getattr(config, "hidden_act", "quick_gelu")
        if act_name not in _ACTIVATIONS:
            raise ModelLoadError(f"unsupported vision activation {act_name!r}")
        head_dim = dim // heads
        if head_dim % 4:
            raise ModelLoadError(f"vision head_dim {head_dim} must be a multiple of 4 (2-D rope)")
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        # Half the head's pairs rotate with the h coordinate, half with w (frequencies of a
        # head_dim/2 rotary, shared by both axes).
        spatial = head_dim // 2
        # A plain float32 attribute on the CPU (not a buffer: built on the meta device, never
        # rounded by `.to(dtype)`), copied to the pixels' device on first use.
        exponents = torch.arange(0, spatial, 2, device=torch.device("cpu")).float() / spatial
        self.inv_freq = 1.0 / theta**exponents  # (head_dim/4,)
        self.patch_embed = PatchEmbed(self.in_channels, self.temporal, self.patch, dim)
        mlp_hidden = int(dim * config.mlp_ratio)
        act = _ACTIVATIONS[act_name]
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, mlp_hidden, act) for _ in range(int(config.depth))
        )
        self.merger = PatchMerger(int(config.hidden_size), dim, self.merge)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal * self.patch * self.patch

    def num_tokens(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def check_grid(self, grid: Sequence[int], rows: int, width: int) -> Grid:
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"image grid {tuple(grid)} is not (t, h, w) patches")
        t, h, w = (int(g) for g in grid)
        if h % self.merge or w % self.merge:
            raise ValueError(f"image grid {tuple(grid)} is not a multiple of merge {self.merge}")
        if rows != t * h * w or width != self.patch_dim:
            raise ValueError(
                f"pixel_values ({rows}, {width}) do not match grid {tuple(grid)}: expected "
                f"({t * h * w}, {self.patch_dim})"
            )
        return t, h, w

    def _rotary(
        self, grids: Sequence[Grid], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin each (N, 1, head_dim/2) float32
        m, pos = self.merge, []
        for t, h, w in grids:
            hh = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            ww = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], 1)
            pos.append(hw.repeat(t, 1))  # (t*h*w, 2) in merge-block-major row order
        positions = torch.cat(pos).float()  # (N, 2)
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        freqs = positions.unsqueeze(-1) * self.inv_freq  # (N, 2, head_dim/4)
        freqs = freqs.flatten(1).unsqueeze(1)  # (N, 1, head_dim/2): [h freqs | w freqs]
        return freqs.cos(), freqs.sin()

    def forward(
        self, pixels: torch.Tensor, grids: Sequence[Grid]
    ) -> torch.Tensor:  # (N, C*T*P*P) -> (N / m^2, hidden)
        by_length: dict[int, list[int]] = {}
        start = 0
        for t, h, w in grids:
            for _ in range(t):  # each frame attends within itself
                by_length.setdefault(h * w, []).append(start)
                start += h * w
        segments = sorted(by_length.items())
        x = self.patch_embed(pixels)  # (N, E)
        cos_sin = self._rotary(grids, x.device)
        for block in self.blocks:
            x = block(x, cos_sin, segments)
        return self.merger(x)
