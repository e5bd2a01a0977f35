"""Engine sizes: device defaults for unset sizes, and the KV cache's share of a GPU."""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.flops import model_shape
from llmfleet.engine.memory import DEFAULT_BYTES, FIXED_RESERVE, activation_reserve, kv_cache_bytes
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError


def test_unset_sizes_take_the_devices_defaults():
    cpu = EngineConfig().resolved()
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 2048)
    gpu = EngineConfig(device="cuda", dtype="bfloat16").resolved()
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)
    sim = EngineConfig(device="cuda", simulate=True).resolved()  # a simulated model is no GPU's
    assert sim.max_num_seqs == 64
    given = EngineConfig(device="cuda", max_num_seqs=7, max_num_batched_tokens=32).resolved()
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (7, 32)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_is_a_share(value):
    with pytest.raises(ValidationError, match="^gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_kv_cache_bytes_off_cuda_is_the_given_size_or_one_gib(make_checkpoint, tmp_path):
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), progress=False)
    shape = model_shape(loaded.model, 4)
    cpu = torch.device("cpu")
    assert kv_cache_bytes(EngineConfig().resolved(), shape, cpu, 4) == DEFAULT_BYTES
    given = EngineConfig(kv_cache_bytes=12345).resolved()
    assert kv_cache_bytes(given, shape, cpu, 4) == 12345
    engine = LLMEngine(EngineConfig(kv_cache_bytes=1 << 20), loaded)
    per_block = (
        2 * 16 * loaded.spec.num_kv_heads * loaded.spec.head_dim * 4 * loaded.spec.num_layers
    )
    assert engine.block_manager.num_blocks == (1 << 20) // per_block


def test_the_step_reserve_grows_with_the_batch(make_checkpoint, tmp_path):
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), progress=False)
    shape = model_shape(loaded.model, 2)
    small = activation_reserve(shape, EngineConfig(max_num_batched_tokens=512).resolved(), 2)
    big = activation_reserve(shape, EngineConfig(max_num_batched_tokens=8192).resolved(), 2)
    assert FIXED_RESERVE < small < big


@pytest.mark.gpu
def test_the_kv_cache_takes_the_workers_share_of_the_gpu(make_checkpoint, tmp_path):
    path = str(make_checkpoint("llama", tmp_path))
    total = torch.cuda.mem_get_info()[1]
    sizes = {}
    for share in (0.2, 0.4):
        loaded = load_model(path, dtype=torch.bfloat16, device="cuda", progress=False)
        config = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=share)
        engine = LLMEngine(config, loaded)
        sizes[share] = engine.block_manager.num_blocks * engine.runner.kv_caches[0][0, 0].nbytes
        sizes[share] *= 2 * len(engine.runner.kv_caches)
        assert torch.cuda.memory_reserved() <= share * total  # the whole worker fits its share
        del engine, loaded
        torch.cuda.empty_cache()
    assert sizes[0.4] - sizes[0.2] == pytest.approx(0.2 * total, rel=0.02)
