"""The step cost model (FLOPs, bytes read and written) against hand computations, against the
parameters of real (tiny) models, and as the engine reports it for the batches it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.flops import (
    ModelShape,
    StepBatch,
    StepCost,
    estimate_step_cost,
    model_shape,
)
from llmfleet.models.loader import load_model
from llmfleet.models.moe import SparseMoE
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

# h=8, 2 query heads and 1 KV head of 4 -> q=8, kv=4; vocab 16; MLP 12; 2-byte weights and KV.
DENSE = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=16,
    intermediate_size=12,
    weight_bytes=2,
    kv_bytes=2,
)
# The same with its second layer a mixture of 4 experts of width 6, 2 per token.
MOE = dataclasses.replace(
    DENSE, num_moe_layers=1, num_experts=4, experts_per_token=2, moe_intermediate_size=6
)
KV_PER_TOKEN = 2 * 2 * 1 * 4 * 2  # layers * (K, V) * kv heads * head_dim * bytes = 32


def test_dense_step_by_hand():
    # A 3-token prefill chunk from position 0 and a decode step at position 5; both sampled.
    cost = estimate_step_cost(DENSE, StepBatch((3, 1), (0, 5), num_sampled=2))
    # Per token and layer: projections 8*(8+4+4) + 8*8 = 192 weights, MLP 3*8*12 = 288.
    linear = 2 * 4 * (2 * 192 + 2 * 288)  # 2 FLOPs per weight, 4 tokens: 7680
    # Keys attended: prefill 1+2+3 = 6, decode 6 -> 12; QK^T and PV 2*8 FLOPs each per key.
    attention = 4 * 2 * 8 * 12  # 4 FLOPs per key and query element, 2 layers, q=8: 768
    lm_head = 2 * 8 * 16 * 2  # 512
    assert cost.flops == linear + attention + lm_head == 8960
    # Weights: layers 2*192 + 2*288 = 960, embedding rows 4*8, LM head 8*16; KV context: the
    # prefill reads its 3 keys, the decode 5 + 1.
    weights = (960 + 32 + 128) * 2
    assert cost.read_bytes == weights + (3 + 6) * KV_PER_TOKEN == 2528
    assert cost.write_bytes == 4 * KV_PER_TOKEN == 128


def test_moe_step_by_hand():
    # One decode token at position 7: its 2 experts of 3*8*6 = 144 weights, router 8*4 = 32.
    cost = estimate_step_cost(MOE, StepBatch((1,), (7,), num_sampled=1))
    per_token = 2 * 192 + 288 + (32 + 2 * 144)  # 992
    assert cost.flops == 2 * per_token + 4 * 2 * 8 * 8 + 2 * 8 * 16 == 2752  # 8 keys
    assert cost.read_bytes == (992 + 8 + 128) * 2 + 8 * KV_PER_TOKEN == 2512
    assert cost.write_bytes == KV_PER_TOKEN

    # Three tokens route to 6 expert slots but there are only 4 experts to read; no LM head.
    cost = estimate_step_cost(MOE, StepBatch((3,), (0,), num_sampled=0))
    assert cost.flops == 2 * 3 * per_token + 4 * 2 * 8 * 6 == 6336  # 1+2+3 keys
    assert cost.read_bytes == (2 * 192 + 288 + 32 + 4 * 144 + 3 * 8) * 2 + 3 * KV_PER_TOKEN
    assert cost.write_bytes == 3 * KV_PER_TOKEN


def test_empty_batch_costs_nothing_and_bad_input_is_refused():
    assert estimate_step_cost(DENSE, StepBatch((), (), 0)) == StepCost()
    with pytest.raises(ValueError, match="num_context_tokens"):
        StepBatch((1, 2), (0,), 1)
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelShape(2, 8, 2, 1, 4, 16, 12, 2, 2, num_moe_layers=1, num_experts=2)


def _active_matmul_weights(model: nn.Module) -> tuple[int, int]:
    """(weights one token multiplies by, weights one single-token step reads) in the layers,
    counted from the parameters themselves."""
    active = read = 0
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, SparseMoE):
                experts = module.w13.numel() + module.w2.numel()
                active += experts * module.top_k // module.num_experts
                read += experts * module.top_k // module.num_experts
            elif isinstance(module, nn.Linear):
                active += module.weight.numel()
                read += module.weight.numel()
    return active, read


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_shape_read_from_the_model_matches_its_parameters(arch, make_checkpoint_module):
    loaded = load_model(str(make_checkpoint_module(arch)), dtype=torch.float32, progress=False)
    shape = model_shape(loaded.model, kv_bytes=2)
    cfg = loaded.model.config
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
    )
    assert (shape.num_heads, shape.num_kv_heads) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    assert shape.weight_bytes == 4
    active, read = _active_matmul_weights(loaded.model)
    # One token at position 0, not sampled: matmuls, plus attention over its own key.
    cost = estimate_step_cost(shape, StepBatch((1,), (0,), num_sampled=0))
    q = shape.num_heads * shape.head_dim
    assert cost.flops == 2 * active + 4 * shape.num_layers * q
    assert cost.read_bytes == (read + shape.hidden_size) * 4 + shape.kv_bytes_per_token


def test_engine_reports_the_cost_of_the_batch_it_ran(make_checkpoint_module):
    loaded = load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)
    engine = LLMEngine(
        EngineConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=64), loaded
    )
    assert engine.last_step_cost == StepCost()
    engine.add_request("a", list(range(3, 16)), SamplingParams(max_tokens=2, ignore_eos=True))
    shape = engine.model_shape
    assert shape.kv_bytes == 4 and shape.num_layers == loaded.spec.num_layers

    engine.step()  # the 13-token prompt in one chunk, sampled
    assert engine.last_step_cost == estimate_step_cost(shape, StepBatch((13,), (0,), 1))
    engine.step()  # one decode token after 13 computed ones
    assert engine.last_step_cost == estimate_step_cost(shape, StepBatch((1,), (13,), 1))
    assert not engine.has_unfinished()
    engine.step()  # nothing scheduled: nothing counted
    assert engine.last_step_cost == StepCost()


def test_quantized_projections_count_in_the_bytes_they_are_stored_in(make_checkpoint_module):
    """FP8 attention projections (1 byte + a float32 scale per row) and packed INT4 MLPs
    (half a byte + scale and zero point per group) read that many bytes, not the
    embedding's 4 per weight."""
    from llmfleet.models.fp8_linear import Fp8Linear
    from llmfleet.models.int4_linear import Int4Linear

    loaded = load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)
    model, g = loaded.model, 16
    expected = 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("qkv_proj", "o_proj"):
            old = getattr(attn, name)
            new = Fp8Linear(
                old.in_features, old.out_features, bias=False, out_dtype=torch.float32, device="cpu"
            )
            setattr(attn, name, new)
            expected += old.in_features * old.out_features + 4 * old.out_features
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(mlp, name)
            new = Int4Linear(
                old.in_features, old.out_features, g, bias=False, dtype=torch.float32, device="cpu"
            )
            setattr(mlp, name, new)
            k, n = old.in_features, old.out_features
            expected += k * n // 2 + 2 * (k // g) * n * 4
    shape = model_shape(model, kv_bytes=2)
    assert shape.weight_bytes == 4
    assert shape.projection_weight_bytes < 1.1 and shape.mlp_weight_bytes < 2
    cost = estimate_step_cost(shape, StepBatch((1,), (0,), num_sampled=0))
    assert cost.read_bytes == expected + shape.hidden_size * 4 + shape.kv_bytes_per_token
