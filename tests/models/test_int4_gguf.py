"""GGUF Q4_0/Q4_1 weights served packed (Int4Linear) instead of dequantized at load.

CPU: the layer against a dense linear of the dequantized weight, and whole tiny llama models
loaded packed (forced; the reference kernel path) against the same file loaded dequantized.
GPU (`-m gpu`): packed on CUDA in float16/bfloat16 (the default there, Triton INT4 kernels)
gives the dequantized model's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from test_gguf import write_tiny_llama_gguf
from tiny_models import (
    PROMPT_LENS,
    Runner,
    build_hf_model,
    greedy_tokens,
    random_prompts,
    top2_margin,
)

from llmfleet.kernels import int4_pack as ip
from llmfleet.models.int4_linear import (
    Int4Linear,
    PackedInt4,
    unloaded_int4_linears,
)
from llmfleet.models.int4_loading import keeps_int4
from llmfleet.models.loader import load_model

Q = gguf.GGMLQuantizationType
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Every projection Q4, the two formats alternating (a fused qkv mixes them); output stays F16.
ALL_Q4 = {name: (Q.Q4_0, Q.Q4_1)[i % 2] for i, name in enumerate(PROJECTIONS)}
ALL_Q4 |= {"token_embd": Q.F16, "output": Q.Q4_0}


def _packed(out_features: int, in_features: int, group: int, dtype: torch.dtype) -> PackedInt4:
    q = torch.randint(0, 16, (in_features, out_features), dtype=torch.uint8)
    scales = (torch.rand(in_features // group, out_features) * 0.02 + 0.005).to(dtype)
    zeros = (torch.randint(0, 16, scales.shape).float() * scales.float()).to(dtype)
    return PackedInt4(ip.pack_int4(q), scales, zeros, group)


def _dense(p: PackedInt4) -> torch.Tensor:  # (out, in) float32
    return ip.dequantize_int4(p.qweight, p.scales, p.zeros, p.group_size).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dense_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    shards = [_packed(24, 128, 32, dtype), _packed(40, 128, 32, dtype)]  # e.g. q and kv rows
    layer = Int4Linear(128, 64, 32, bias=True, dtype=dtype, device="cpu")
    layer.load_shard(shards[0], 0)
    layer.load_shard(shards[1], 24)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(64))
    x = torch.randn(3, 5, 128).to(dtype)
    out = layer(x)
    w = torch.cat([_dense(p) for p in shards])
    ref = F.linear(x.float(), w, layer.bias.float())
    assert out.shape == (3, 5, 64) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_shard(shards[1], 30)


def test_packed_rows_permute_with_the_dense_rows() -> None:
    p = _packed(16, 64, 32, torch.float32)
    perm = torch.randperm(16).numpy()
    assert torch.equal(_dense(p.permute_rows(perm)), _dense(p)[perm])


def _write(tmp_path: Path, quant_of: dict, **overrides) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(build_hf_model("llama", **overrides), path, quant_of)
    return path


def _int4_modules(loaded) -> set[str]:
    return {n for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LLMFLEET_CACHE_DIR", str(tmp_path / "cache"))


def test_q4_gguf_packed_gives_the_dequantized_logits(tmp_path: Path, cache_dir) -> None:
    path = _write(tmp_path, ALL_Q4)
    dense = load_model(str(path), progress=False)  # CPU default: dequantized at load
    packed = load_model(str(path), progress=False, int4_weights=True)
    assert not _int4_modules(dense)
    layers = range(dense.spec.num_layers)
    projections = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert _int4_modules(packed) == {f"layers.{i}.{p}" for i in layers for p in projections}
    assert isinstance(packed.model.lm_head, torch.nn.Linear)  # the output head stays dense
    prompts = random_prompts(dense.spec.vocab_size)
    a = Runner(dense, PROMPT_LENS).step(prompts, [0, 0, 0])
    b = Runner(packed, PROMPT_LENS).step(prompts, [0, 0, 0])
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_mixed_quant_types_pack_only_whole_q4_weights(tmp_path: Path, cache_dir) -> None:
    # q Q8_0 + k Q4_0 + v Q4_1 fuse into qkv_proj: one non-Q4 shard keeps it dense; the same
    # for gate (Q4_1) + up (Q8_0); o_proj is BF16; down_proj (Q4_0) alone packs.
    quant_of = {**ALL_Q4, "attn_q": Q.Q8_0, "ffn_up": Q.Q8_0, "attn_output": Q.BF16}
    path = _write(tmp_path, quant_of)
    packed = load_model(str(path), progress=False, int4_weights=True)
    layers = range(packed.spec.num_layers)
    assert _int4_modules(packed) == {f"layers.{i}.mlp.down_proj" for i in layers}
    dense = load_model(str(path), progress=False)
    prompts = random_prompts(dense.spec.vocab_size)
    for x, y in zip(
        Runner(dense, PROMPT_LENS).step(prompts, [0, 0, 0]),
        Runner(packed, PROMPT_LENS).step(prompts, [0, 0, 0]),
        strict=True,
    ):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def test_int4_rows_loaded_are_accounted(tmp_path: Path, cache_dir) -> None:
    loaded = load_model(str(_write(tmp_path, ALL_Q4)), progress=False, int4_weights=True)
    assert unloaded_int4_linears(loaded.model) == []
    loaded.model.get_submodule("layers.1.mlp.down_proj").num_rows_loaded -= 16  # a lost shard
    assert unloaded_int4_linears(loaded.model) == ["layers.1.mlp.down_proj"]
    assert keeps_int4("cuda", torch.bfloat16) and not keeps_int4("cpu", torch.bfloat16)
    assert not keeps_int4("cuda", torch.float32)


# ---- GPU ----


def _greedy(loaded, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from llmfleet.engine.engine import LLMEngine
    from llmfleet.shared.core.config import EngineConfig

    dtype = str(loaded.spec.dtype).removeprefix("torch.")
    cfg = EngineConfig(
        device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64, max_num_batched_tokens=64
    )
    return greedy_tokens(LLMEngine(cfg, loaded), prompts, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_packed_q4_gives_the_dequantized_greedy_tokens(tmp_path: Path, cache_dir, dtype):
    """32 greedy steps for 3 prompts (decode M = 1..3: both INT4 decode kernels; prefill the
    tile kernel), packed vs dequantized, both on the GPU in `dtype`. Tokens must match; a
    divergence is tolerated only where the dequantized model's own top-2 logits lie within
    the 16-bit tolerance (1e-2 of the largest logit in float16, 4e-2 in bfloat16) of each
    other, a tie the two weight roundings may break either way."""
    path = _write(tmp_path, ALL_Q4, hidden_size=256, intermediate_size=512, head_dim=64)
    packed = load_model(str(path), dtype=dtype, device="cuda", progress=False)
    dense = load_model(str(path), dtype=dtype, device="cuda", progress=False, int4_weights=False)
    assert len(_int4_modules(packed)) == 4 * packed.spec.num_layers and not _int4_modules(dense)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 23, 61)]
    got, ref = _greedy(packed, prompts, 32), _greedy(dense, prompts, 32)
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    for prompt, a, b in zip(prompts, got, ref, strict=True):
        assert len(a) == len(b) == 32
        first = next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), None)
        if first is not None:
            assert top2_margin(dense, prompt + b[:first]) < tol, (first, a, b)
