"""AWQ and GPTQ checkpoints (4-bit, HF layout): their tensors in our INT4 layout.

A checkpoint directory whose config.json has a `quantization_config` with `quant_method`
"awq" or "gptq" stores each quantized linear layer `<m>` (HF name) as

    AWQ (GEMM)   <m>.qweight (K, N // 8) int32   8 output columns per word, in the nibble order
                                                  0, 2, 4, 6, 1, 3, 5, 7 (column c of a word at
                                                  bits 4 * AWQ_ORDER.index(c))
                 <m>.qzeros  (K // G, N // 8) int32, the same packing
                 <m>.scales  (K // G, N) fp16
                 W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    GPTQ         <m>.qweight (K // 8, N) int32   8 input rows per word, row 8 i + j at bits 4 j
                 <m>.qzeros  (groups, N // 8) int32, 8 columns per word at bits 4 j; format
                              "gptq" (v1) stores z - 1, "gptq_v2" stores z
                 <m>.scales  (groups, N) fp16
                 <m>.g_idx   (K,) int32, the group of each input row (optional: k // G)
                 W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

with K = in_features, N = out_features, G = group_size (-1: one group, G = K). GPTQ's qweight
is already our layout (kernels/int4_pack.py); AWQ's is repacked along the input dimension.
Both become `PackedInt4` (zeros = z * s). A layer whose g_idx is not k // G (GPTQ with
`desc_act`, "act order") has no grouped form and is dequantized at load, as is every layer
on the CPU and every layer the INT4 kernel cannot serve (group sizes it lacks).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llmfleet.kernels.int4_pack import GROUP_SIZES, dequantize_int4, pack_int4, unpack_int4
from llmfleet.models.int4_linear import PackedInt4
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of each nibble of an AWQ word
_REQUIRED = ("qweight", "qzeros", "scales")
_PARTS = (*_REQUIRED, "g_idx")


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """A checkpoint's `quantization_config`, validated."""

    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group per column
    zero_offset: int  # added to stored GPTQ zero points: 1 for format "gptq" (v1), else 0
    act_order: bool = False  # GPTQ desc_act: groups follow g_idx, not k // G

    @property
    def packed_group_size(self) -> int | None:
        """The group size its layers are served packed with; None: they are dequantized."""
        return None if self.act_order else kernel_group_size(self.group_size)


def kernel_group_size(group_size: int) -> int | None:
    """The group size the INT4 kernel serves groups of `group_size` with: itself when the
    kernel has it, the largest it has for multiples of that (scales repeated); else None."""
    if group_size in GROUP_SIZES:
        return group_size
    top = max(GROUP_SIZES)
    return top if group_size > 0 and group_size % top == 0 else None


def checkpoint_format(config: Any) -> Int4CheckpointFormat | None:
    """The INT4 format of an HF config, None when it is not quantized; ModelLoadError for a
    quantization this loader cannot read (it names the field)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelLoadError(
            f"quantization_config.quant_method {method!r} is not supported (awq, gptq are)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"quantization_config.bits is {bits!r}; only 4-bit is supported")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group != -1 and (group <= 0 or group % 8):
        raise ModelLoadError(f"quantization_config.group_size {group} is not a multiple of 8")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                f"quantization_config.version {version!r}: only AWQ's GEMM layout is supported"
            )
        if qc.get("zero_point", True) is False:
            raise ModelLoadError(
                "quantization_config.zero_point false (AWQ without zero points) is not supported"
            )
        return Int4CheckpointFormat("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)"
        )
    act_order = bool(qc.get("desc_act", False))
    return Int4CheckpointFormat("gptq", group, 1 if fmt == "gptq" else 0, act_order)


# ---- nibbles -----------------------------------------------------------------------------


def _unpack_columns(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """(R, C // 8) int32 packed along columns -> (R, C) int64 in 0..15. Nibble j (bits 4j)
    holds column 8 c + order[j] (order None: j)."""
    nib = unpack_int4(words.t()).t().to(torch.int64)  # column 8 c + j = nibble j of word c
    if order is None:
        return nib
    r, c = nib.shape
    by_nibble = nib.reshape(r, c // 8, 8)
    by_column = torch.empty_like(by_nibble)
    by_column[..., list(order)] = by_nibble
    return by_column.reshape(r, c)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{name}: {what} must be {shape}, got {tuple(t.shape)}")


def awq_to_packed(
    name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> PackedInt4:
    """One AWQ layer's tensors as a PackedInt4 (its weight exactly, see the module docstring)."""
    k, n8 = qweight.shape
    n = n8 * 8
    g = k if group_size == -1 else group_size
    if k % g or k % 8:
        raise ModelLoadError(f"{name}: in_features {k} is not a multiple of group size {g}")
    _check(name, qzeros, (k // g, n8), "qzeros")
    _check(name, scales, (k // g, n), "scales")
    q = _unpack_columns(qweight, AWQ_ORDER)  # (K, N)
    z = _unpack_columns(qzeros, AWQ_ORDER)  # (K // G, N)
    s = scales
    return PackedInt4(pack_int4(q), s, (z.to(torch.float32) * s.float()).to(s.dtype), g)


def gptq_to_packed(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
) -> PackedInt4 | torch.Tensor:
    """One GPTQ layer: a PackedInt4, or (act order: g_idx is not k // G) the dense weight
    (out, in) float32."""
    k8, n = qweight.shape
    k = k8 * 8
    g = k if group_size == -1 else group_size
    groups = scales.shape[0]
    _check(name, scales, (groups, n), "scales")
    _check(name, qzeros, (groups, n // 8), "qzeros")
    z = _unpack_columns(qzeros) + zero_offset  # (groups, N)
    zs = (z.to(torch.float32) * scales.float()).to(scales.dtype)
    sequential = torch.arange(k, device=qweight.device) // g
    if g_idx is not None:
        _check(name, g_idx, (k,), "g_idx")
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ModelLoadError(f"{name}: g_idx refers to groups outside 0..{groups - 1}")
    if g_idx is None or torch.equal(g_idx.to(torch.int64), sequential):
        if k % g or groups != k // g:
            raise ModelLoadError(f"{name}: {groups} groups do not split {k} inputs by {g}")
        return PackedInt4(qweight.to(torch.int32), scales, zs, g)
    # Act order: row k belongs to group g_idx[k]; dequantize row by row.
    rows = g_idx.to(torch.long)
    q = unpack_int4(qweight.to(torch.int32)).float()  # (K, N)
    return (q * scales.float()[rows] - zs.float()[rows]).t().contiguous()


def dense_weight(p: PackedInt4) -> torch.Tensor:
    """The (out, in) float32 weight a PackedInt4 stands for."""
    return dequantize_int4(p.qweight, p.scales, p.zeros, p.group_size).t().contiguous()


def servable_group(p: PackedInt4) -> PackedInt4 | None:
    """`p` regrouped to `kernel_group_size` (scales and zeros repeated); None without one."""
    g = kernel_group_size(p.group_size)
    if g is None:
        return None
    rep = p.group_size // g
    return PackedInt4(
        p.qweight, p.scales.repeat_interleave(rep, 0), p.zeros.repeat_interleave(rep, 0), g
    )


# ---- streaming a checkpoint --------------------------------------------------------------


def quantized_modules(names: Iterable[str]) -> dict[str, set[str]]:
    """HF module name -> the quantized parts present (`qweight`, `qzeros`, `scales`, `g_idx`)."""
    found: dict[str, set[str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if part in _PARTS:
            found.setdefault(module, set()).add(part)
    return found


def int4_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: Int4CheckpointFormat,
    modules: dict[str, set[str]],
    *,
    packed: frozenset[str],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor | PackedInt4]]:
    """The checkpoint's tensors with each quantized module's parts merged into one
    `<module>.weight`: a PackedInt4 (activation `dtype`) when its HF name is in `packed` and it
    has a grouped form the kernel serves, else the dense weight in `dtype`. Other tensors pass
    through. Parts may arrive in any order, across files."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if module not in modules or part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if set(parts) != modules[module]:
            continue
        del pending[module]
        weight_name = f"{module}.weight"
        yield weight_name, _convert(weight_name, parts, fmt, weight_name in packed, dtype)
    if pending:
        missing = {m: sorted(set(_REQUIRED) - set(p)) for m, p in pending.items()}
        raise ModelLoadError(f"quantized modules lack tensors: {missing}")


def _convert(
    name: str,
    parts: dict[str, torch.Tensor],
    fmt: Int4CheckpointFormat,
    keep_packed: bool,
    dtype: torch.dtype,
) -> torch.Tensor | PackedInt4:
    for part in _REQUIRED:
        if part not in parts:
            raise ModelLoadError(f"{name}: the checkpoint has no {part} for it")
    scales = parts["scales"].to(dtype)
    if fmt.method == "awq":
        got: PackedInt4 | torch.Tensor = awq_to_packed(
            name, parts["qweight"], parts["qzeros"], scales, fmt.group_size
        )
    else:
        got = gptq_to_packed(
            name,
            parts["qweight"],
            parts["qzeros"],
            scales,
            parts.get("g_idx"),
            fmt.group_size,
            fmt.zero_offset,
        )
    if keep_packed:
        servable = None if isinstance(got, torch.Tensor) else servable_group(got)
        if servable is None:  # the loader chose packed layers from the config: it lied
            raise ModelLoadError(
                f"{name}: its g_idx or group size contradicts quantization_config "
                "(desc_act false, a group size the INT4 kernel serves)"
            )
        return servable
    return (got if isinstance(got, torch.Tensor) else dense_weight(got)).to(dtype)
