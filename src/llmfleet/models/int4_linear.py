"""Linear layers that keep INT4 weights packed (GGUF Q4_0 / Q4_1 served without dequantizing).

A packed weight W (out_features, in_features) is held in the layout of kernels/int4_matmul.py:

    qweight (in // 8, out) int32    8 nibbles per word along the input dimension
    scales  (in // G, out)          activation dtype
    zeros   (in // G, out)          activation dtype, scaled zero point: W^T = q * scales - zeros

Output features are columns, so the row shards of a fused projection (q/k/v into qkv_proj,
gate/up into gate_up_proj) are column ranges of all three tensors; `load_shard` copies one in.
The forward pass runs the Triton INT4 kernel on a GPU (kernels/dispatch.py) and the PyTorch
reference elsewhere. The loader uses this layer on CUDA in float16/bfloat16 only; on the CPU
GGUF weights are dequantized at load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmfleet.kernels.int4_pack import int4_matmul_ref
from llmfleet.models.layers import row_parallel_group, rowwise_linear
from llmfleet.models.parallel import Shard, TensorParallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedInt4:
    """One checkpoint tensor (out rows, in columns) in packed form; see the module docstring."""

    qweight: torch.Tensor  # (in // 8, out) int32
    scales: torch.Tensor  # (in // G, out)
    zeros: torch.Tensor  # (in // G, out)
    group_size: int

    def __post_init__(self) -> None:
        in8, out = self.qweight.shape
        groups = in8 * 8 // self.group_size
        if self.qweight.dtype != torch.int32 or in8 * 8 % self.group_size:
            raise ValueError(f"qweight must be int32 (in // 8, out), got {self.qweight.shape}")
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != (groups, out):
                raise ValueError(f"{name} must be ({groups}, {out}), got {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features), the shape of the dense weight it stands for."""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def shard(self, shard: Shard | None) -> PackedInt4:
        """The part of the weight a tensor-parallel rank loads (`Shard` in the dense (out, in)
        layout, parallel.py): output rows are columns of every buffer; input columns are rows
        of qweight (8 a word) and of scales and zeros (one a group), on group boundaries."""
        if shard is None:
            return self
        dim, pieces = shard
        g = self.group_size
        if dim == 0:  # output rows: the same columns of every buffer
            cut = [_cut(t, pieces, 1, 1) for t in (self.qweight, self.scales, self.zeros)]
            return PackedInt4(*cut, g)
        if any(r.start % g or r.stop % g for r in pieces):
            raise ValueError(f"input columns {pieces} do not fall on groups of {g}")
        scales, zeros = (_cut(t, pieces, 0, g) for t in (self.scales, self.zeros))
        return PackedInt4(_cut(self.qweight, pieces, 0, 8), scales, zeros, g)

    def permute_rows(self, perm: np.ndarray) -> PackedInt4:
        """The same weight with output rows reordered: row i of the result is row perm[i]."""
        idx = torch.as_tensor(perm, dtype=torch.long, device=self.qweight.device)
        return PackedInt4(
            self.qweight[:, idx].contiguous(),
            self.scales[:, idx].contiguous(),
            self.zeros[:, idx].contiguous(),
            self.group_size,
        )


def _cut(t: torch.Tensor, pieces: tuple[range, ...], dim: int, unit: int) -> torch.Tensor:
    """The `pieces` of `t` along `dim`, in units of `unit` (8 weights a word, a group's row)."""
    parts = [t.narrow(dim, r.start // unit, len(r) // unit) for r in pieces]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()


class Int4Linear(nn.Module):
    """y = x W^T + b with W packed as INT4 with group scales and zero points.

    Invariants: `qweight`, `scales` and `zeros` are buffers written only by `load_shard`
    (every output column exactly once before the first forward); `bias`, when present, is an
    ordinary parameter loaded by the model's weight loader. With `tp` (a row-parallel
    projection's rank: its input columns) the partial outputs are summed over the group, then
    the bias is added once, as in layers.RowParallelLinear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if in_features % group_size or group_size % 8:
            raise ValueError(
                f"in_features={in_features} must be a multiple of group_size={group_size} (of 8)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        groups = in_features // group_size
        words = torch.zeros(in_features // 8, out_features, dtype=torch.int32, device=device)
        self.register_buffer("qweight", words)
        per_group = torch.zeros(groups, out_features, dtype=dtype, device=device)
        self.register_buffer("scales", per_group)
        self.register_buffer("zeros", per_group.clone())
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.num_rows_loaded = 0
        self.tp = tp

    def load_shard(self, packed: PackedInt4, offset: int = 0) -> None:
        """Copy `packed` into output rows offset .. offset + its rows (columns of the buffers)."""
        rows, cols = packed.shape
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(
                f"packed shard of shape {(rows, cols)} at row {offset} does not fit "
                f"({self.out_features}, {self.in_features})"
            )
        if packed.group_size != self.group_size:
            raise ValueError(f"shard group size {packed.group_size} != {self.group_size}")
        with torch.no_grad():
            self.qweight[:, offset : offset + rows].copy_(packed.qweight)
            self.scales[:, offset : offset + rows].copy_(packed.scales)
            self.zeros[:, offset : offset + rows].copy_(packed.zeros)
        self.num_rows_loaded += rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.is_cuda:  # the Triton kernel; Triton is only needed (and imported) on GPUs
            from llmfleet.kernels import dispatch

            fn = dispatch.int4_matmul
        else:
            fn = int4_matmul_ref

        def matmul(x2: torch.Tensor) -> torch.Tensor:
            return fn(x2, self.qweight, self.scales, self.zeros, self.group_size)

        return rowwise_linear(x, self.out_features, self.bias, matmul, self.tp)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
            + (f", row-parallel over {self.tp.size} ranks" if self.tp is not None else "")
        )


def use_int4_linears(
    model: nn.Module, weight_names: Iterable[str], group_size: int, dtype: torch.dtype
) -> list[str]:
    """Replace the nn.Linear owning each `<module>.weight` in `weight_names` by an Int4Linear
    on the same device (empty, to be filled by the loader). Returns the module names."""
    replaced = []
    for weight_name in sorted(set(weight_names)):
        module_name = weight_name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{module_name} is a {type(old).__name__}, not nn.Linear")
        new = Int4Linear(
            old.in_features,
            old.out_features,
            group_size,
            bias=old.bias is not None,
            dtype=dtype,
            device=old.weight.device,
            tp=row_parallel_group(old),
        )
        setattr(parent, attr, new)
        replaced.append(module_name)
    if replaced:
        logger.info("%d linear layers keep their INT4 weights packed", len(replaced))
    return replaced


def unloaded_int4_linears(model: nn.Module) -> list[str]:
    """Names of Int4Linear modules whose every output row has not been loaded exactly once."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, Int4Linear) and m.num_rows_loaded != m.out_features
    ]
