"""How many KV blocks a drafting proposer's own cache (draft model, EAGLE head) gets.

The draft cache holds as many tokens as the engine's: `num_kv_blocks` when the config sets it,
else the engine's budget (`engine/memory.py`: `kv_cache_bytes`, or on CUDA what the GPU share
leaves) split between the two caches in proportion to their bytes per block, so both get the
same block count. It never exceeds what `max_num_seqs` sequences of the longest context (plus
the drafts) can use.

On CUDA the proposer should be built (its weights loaded, this cache allocated) before the
engine sizes its own cache, which then counts them as memory this process holds. Built after
it, the budget is spent: the draft cache then takes what the device has free beyond a step's
activation reserve (a warning says so).
"""

from __future__ import annotations

import logging

import torch

from llmfleet.engine import flops
from llmfleet.engine.memory import activation_reserve, kv_cache_bytes
from llmfleet.engine.model_runner import kv_bytes_per_block
from llmfleet.models.loader import LoadedModel
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import CapacityError
from llmfleet.shared.core.speculative import MAX_SPECULATIVE_TOKENS

logger = logging.getLogger(__name__)


def max_model_len(config: EngineConfig, target: LoadedModel) -> int:
    """The engine's context limit for `target` (as LLMEngine derives it)."""
    own = target.spec.max_model_len
    return min(config.max_model_len or own, own)


def draft_num_blocks(
    config: EngineConfig, target: LoadedModel, draft_block_bytes: int, device: torch.device
) -> int:
    """Blocks of `draft_block_bytes` for a draft cache beside `target`'s (see the module
    docstring); `config` is resolved."""
    bs = config.block_size
    per_seq = -(-(max_model_len(config, target) + MAX_SPECULATIVE_TOKENS) // bs)
    cap = max(1, (config.max_num_seqs or 1) * per_seq)
    if config.num_kv_blocks:
        return min(config.num_kv_blocks, cap)
    dtype = config.torch_dtype
    target_bytes = kv_bytes_per_block(target.spec, bs, dtype)
    shape = flops.model_shape(target.model, dtype.itemsize)
    try:
        budget = kv_cache_bytes(config, shape, device, dtype.itemsize)
    except CapacityError:
        budget = 0
    blocks = budget // (target_bytes + draft_block_bytes)
    if device.type == "cuda" and blocks < per_seq:  # the engine's cache took the budget
        free = torch.cuda.mem_get_info(device)[0] - activation_reserve(
            shape, config, dtype.itemsize
        )
        blocks = free // draft_block_bytes
        logger.warning("draft KV cache sized from the free GPU memory: %d blocks", blocks)
        if blocks < per_seq:
            raise CapacityError(
                "no GPU memory left for the draft's KV cache: lower gpu_memory_utilization "
                "or set num_kv_blocks"
            )
    return max(1, min(cap, blocks))


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype):
    """Bytes of one block of a cache of `num_layers` layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * elem * num_layers
