"""How many bytes the KV cache gets.

An explicit `kv_cache_bytes` is used as it is. Unset, on a CUDA device the cache takes what this
worker's share of the GPU leaves once the weights are loaded, less a reserve for a step's
activations, the sampler's logits and the CUDA graphs:

    kv = total * gpu_memory_utilization - memory this process holds - reserve

capped by what the device has free (another process may hold part of it). Two workers on one
GPU (prefill and decode on one card) each get their `gpu_memory_utilization` share, so the
split is explicit. Off CUDA (and for a simulated model) the unset default is 1 GiB.

The reserve is an estimate from the model's shape, on the safe side: twice the activations of a
step of `max_num_batched_tokens` tokens (the residual stream, attention inputs and outputs, the
MLP's or routed experts' intermediates), twice the float32 logits of `max_num_seqs` rows, and
`FIXED_RESERVE` for CUDA graphs, kernels' workspaces and the allocator's fragmentation.
"""

from __future__ import annotations

import logging

import torch

from llmfleet.engine.flops import ModelShape
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import CapacityError

logger = logging.getLogger(__name__)

DEFAULT_BYTES = 1 << 30
FIXED_RESERVE = 1 << 30
GiB = float(1 << 30)


def activation_reserve(shape: ModelShape, config: EngineConfig, dtype_bytes: int) -> int:
    """Bytes set aside for one step's transient tensors (see the module docstring)."""
    tokens, rows = config.max_num_batched_tokens or 0, config.max_num_seqs or 0
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_token = 4 * shape.hidden_size + 2 * (q + 2 * kv)
    if shape.num_moe_layers:
        per_token += shape.experts_per_token * 3 * shape.moe_intermediate_size
    if shape.num_dense_layers:
        per_token += 3 * shape.intermediate_size
    logits = rows * shape.vocab_size * 4
    return 2 * tokens * per_token * dtype_bytes + 2 * logits + FIXED_RESERVE


def kv_cache_bytes(
    config: EngineConfig, shape: ModelShape | None, device: torch.device, dtype_bytes: int
) -> int:
    """The KV cache's size for `config` (resolved) on `device`, with the weights loaded."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda" or shape is None:
        return DEFAULT_BYTES
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    reserve = activation_reserve(shape, config, dtype_bytes)
    share = int(total * config.gpu_memory_utilization)
    budget = min(share - held - reserve, free - reserve)
    logger.info(
        "GPU memory: %.1f GiB total, share %.2f = %.1f GiB; weights and buffers %.1f GiB, "
        "reserve for a step %.1f GiB, free %.1f GiB -> KV cache %.1f GiB",
        total / GiB,
        config.gpu_memory_utilization,
        share / GiB,
        held / GiB,
        reserve / GiB,
        free / GiB,
        max(budget, 0) / GiB,
    )
    if budget <= 0:
        raise CapacityError(
            f"no GPU memory left for a KV cache: the share ({share / GiB:.1f} GiB, "
            f"gpu_memory_utilization {config.gpu_memory_utilization}) is taken by the weights "
            f"({held / GiB:.1f} GiB) and the step reserve ({reserve / GiB:.1f} GiB), or only "
            f"{free / GiB:.1f} GiB is free"
        )
    return budget


def num_kv_blocks(
    config: EngineConfig, shape: ModelShape | None, device: torch.device, block_bytes: int
) -> int:
    """The KV cache's block count: `config.num_kv_blocks`, else `kv_cache_bytes` worth of
    blocks of `block_bytes` (at least one); `config` is resolved."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    return max(1, kv_cache_bytes(config, shape, device, config.torch_dtype.itemsize) // block_bytes)
