"""Which linear weights a load keeps packed as INT4 (`Int4Linear`) rather than dequantizing:
GGUF Q4_0/Q4_1 tensors and AWQ/GPTQ checkpoint modules, where the model's layer and the
kernel's group sizes allow."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmfleet.kernels.int4_pack import GGUF_BLOCK
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.gguf_file import GGUFFile, hf_tensor_name
from llmfleet.models.int4_checkpoint import Int4CheckpointFormat, int4_tensors, quantized_modules
from llmfleet.models.int4_linear import use_int4_linears
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)


def keeps_int4(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether GGUF Q4 weights stay packed by default: on CUDA with 16-bit activations (the
    Triton kernel's dtypes). CPU loads dequantize."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def packed_linear_targets(
    model: DecoderForCausalLM, hf_names: Iterable[str], quantized: set[str], group_size: int
) -> tuple[set[str], set[str]]:
    """The nn.Linear weights of `model` that can keep INT4 weights packed, and the HF names of
    their checkpoint tensors. A weight qualifies when every tensor loaded into it is in
    `quantized` (a fused qkv or gate_up projection needs all of its shards so); embeddings,
    the output head and stacked experts stay dense. Under tensor parallelism a row-parallel
    weight (o_proj, down_proj: its input columns split) qualifies only where this rank's
    columns start and end on `group_size` boundaries; else it is dequantized."""
    sources: dict[str, list[str]] = {}
    for hf in hf_names:
        target = model.weight_target(hf)
        if target is not None:
            name, expert, _ = target
            sources.setdefault(name if expert is None else f"{name}[{expert}]", []).append(hf)
    targets = {
        name
        for name, names in sources.items()
        if name.endswith(".weight")
        and name != "lm_head.weight"
        and all(h in quantized and _group_aligned(model, h, group_size) for h in names)
        and isinstance(model.get_submodule(name.removesuffix(".weight")), nn.Linear)
    }
    return targets, {h for name in targets for h in sources[name]}


def _group_aligned(model: DecoderForCausalLM, hf_name: str, group_size: int) -> bool:
    """Whether this rank's part of `hf_name` keeps whole groups of its input columns."""
    shard = model.weight_shard(hf_name)
    if shard is None or shard[0] == 0:  # whole, or a range of output rows
        return True
    return all(r.start % group_size == 0 and r.stop % group_size == 0 for r in shard[1])


def int4_packed_weights(gf: GGUFFile, model: DecoderForCausalLM) -> tuple[set[str], set[str]]:
    """`packed_linear_targets` of a GGUF file: its Q4_0/Q4_1 tensors qualify."""
    names = [hf_tensor_name(t.name) for t in gf.reader.tensors]
    return packed_linear_targets(model, names, gf.q4_weight_names(), GGUF_BLOCK)


def int4_checkpoint_weights(
    model: DecoderForCausalLM,
    names: list[str],
    weights: Iterable[tuple[str, Any]],
    fmt: Int4CheckpointFormat,
    dtype: torch.dtype,
    keep_int4: bool,
) -> tuple[Iterator[tuple[str, Any]], int]:
    """An AWQ/GPTQ checkpoint's tensors for `load_weights` (and their count): each quantized
    module merged into one weight, packed into an Int4Linear where `keep_int4` and the format
    allow, else dequantized."""
    modules = quantized_modules(names)
    if not modules:
        raise ModelLoadError(f"config says {fmt.method.upper()} but no tensor is a .qweight")
    group = fmt.packed_group_size
    packed: set[str] = set()
    if keep_int4 and group is not None:
        merged = [f"{m}.weight" for m in modules]
        targets, packed = packed_linear_targets(model, [*names, *merged], set(merged), group)
        use_int4_linears(model, targets, group, dtype)
    elif keep_int4:
        logger.info(
            "%s checkpoint (group size %d%s) is dequantized at load: no packed kernel form",
            fmt.method.upper(),
            fmt.group_size,
            ", act order" if fmt.act_order else "",
        )
    total = len(names) - sum(len(parts) - 1 for parts in modules.values())
    merged_weights = int4_tensors(weights, fmt, modules, packed=frozenset(packed), dtype=dtype)
    return merged_weights, total
