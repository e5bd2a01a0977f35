"""Online FP8 quantization (`quantization="fp8"`): Fp8Linear and the loaded model.

CPU: the layer (PyTorch reference GEMM) against a float linear, the replacement of the decoder
projections in a tiny model, and the validation of `quantization`. GPU (`-m gpu`): a tiny llama
loaded in bfloat16 with and without FP8 gives the same greedy tokens (up to near-ties), close
logits, and runs with CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import (
    PROMPT_LENS,
    Runner,
    greedy_tokens,
    prefill_logits,
    random_prompts,
    top2_margin,
)

from llmfleet.kernels.quant import per_token_quant_ref
from llmfleet.models.fp8_linear import Fp8Linear, use_fp8_linears
from llmfleet.models.layers import Linear
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2**-4 of itself.
E4M3_REL = 2.0**-4


def _fp8_modules(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_quantize_dequantize_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight[5].zero_()  # an all-zero output channel stays exactly zero
        linear.weight[7] *= 100.0  # channels of very different ranges get their own scales
    layer = Fp8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (96,)
    w = linear.weight.float()
    w_dq = layer.dequantized_weight()
    bound = E4M3_REL * w.abs() + 2.0**-9 * layer.weight_scale[:, None]  # + subnormal step
    assert bool(((w_dq - w).abs() <= bound).all())
    assert bool((w_dq[5] == 0).all()) and layer.weight.float().abs().amax().item() == 448.0

    x = torch.randn(3, 5, 256).to(dtype)
    out = layer(x)
    assert out.shape == (3, 5, 96) and out.dtype == dtype and bool(out.isfinite().all())
    # Exactly the math of the reference: activations quantized per token, dequantized matmul.
    xq, xs = per_token_quant_ref(x.reshape(15, 256))
    want = F.linear(xq.float() * xs, w_dq, linear.bias.float()).view(3, 5, 96)
    assert _rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    # And close to the unquantized layer: two e4m3 roundings per product.
    ref = F.linear(x.float(), w, linear.bias.float())
    assert _rel_err(out, ref) < 0.05
    assert (layer(torch.zeros(2, 256).to(dtype)) == linear.bias).all()  # zero rows: bias only


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_decoder_projections_become_fp8(arch: str, make_checkpoint_module) -> None:
    # On the CPU (reference GEMM): use_fp8_linears is what load_model runs for "fp8" on CUDA.
    path = str(make_checkpoint_module(arch))
    ref = load_model(path, progress=False)
    loaded = load_model(path, progress=False)
    names = use_fp8_linears(loaded.model)
    layers = range(loaded.spec.num_layers)
    has_mlp = [type(layer.mlp).__name__ == "MLP" for layer in loaded.model.layers]
    want = {f"layers.{i}.{p}" for i in layers for p in PROJECTIONS if has_mlp[i] or "attn" in p}
    assert set(names) == _fp8_modules(loaded.model) == want
    assert type(loaded.model.lm_head) is Linear  # the output head stays dense
    if arch == "qwen3_moe":  # router and stacked experts stay in the model's dtype
        moe = next(layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "w13"))
        assert type(moe.gate) is torch.nn.Linear and moe.w13.dtype == torch.float32
    prompts = random_prompts(ref.spec.vocab_size)
    a = Runner(ref, PROMPT_LENS).step(prompts, [0, 0, 0])
    b = Runner(loaded, PROMPT_LENS).step(prompts, [0, 0, 0])
    errs = [_rel_err(y, x) for x, y in zip(a, b, strict=True)]
    assert max(errs) < 0.1, errs


def test_quantization_is_validated(make_checkpoint_module) -> None:
    with pytest.raises(ValidationError) as e:
        EngineConfig(quantization="int8")
    assert e.value.field == "quantization"
    with pytest.raises(ValidationError, match="fp8 needs device cuda") as e:
        EngineConfig(quantization="fp8", dtype="bfloat16")  # device cpu
    assert e.value.field == "quantization"
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(quantization="fp8", device="cuda")  # float32
    cfg = EngineConfig(quantization="fp8", device="cuda", dtype="bfloat16")
    assert cfg.quantization == "fp8"

    path = str(make_checkpoint_module("llama"))
    with pytest.raises(ValidationError, match="sm_89") as e:
        load_model(path, dtype=torch.bfloat16, device="cpu", quantization="fp8", progress=False)
    assert e.value.field == "quantization"
    with pytest.raises(ValidationError, match="bfloat16 or float16"):
        load_model(path, dtype=torch.float32, quantization="fp8", progress=False)
    with pytest.raises(ValidationError, match="must be fp8"):
        load_model(path, quantization="fp4", progress=False)


def test_quantization_flag_reaches_the_engine_config(monkeypatch) -> None:
    from llmfleet.services.worker.__main__ import parse_config
    from llmfleet.shared.core.config import from_env

    _, engine, _ = parse_config(
        ["--device", "cuda", "--dtype", "bfloat16", "--quantization", "fp8"]
    )
    assert engine.quantization == "fp8"
    _, engine, _ = parse_config([])
    assert engine.quantization is None
    monkeypatch.setenv("LLMFLEET_QUANTIZATION", "fp8")
    monkeypatch.setenv("LLMFLEET_DEVICE", "cuda")
    monkeypatch.setenv("LLMFLEET_DTYPE", "float16")
    assert from_env(EngineConfig).quantization == "fp8"
    with pytest.raises(SystemExit):
        parse_config(["--quantization", "int4"])


# ---- GPU ----


# FP8 serving tolerance, relative to the largest logit: a divergence of greedy tokens is
# accepted only where the bf16 model's own top-2 logits are closer than this. Random tiny
# models have no outlier structure to hide rounding in: on the CPU reference the logits of
# this checkpoint differ by 6-7% (Frobenius) and at most 8% of the largest logit, so a near
# tie within twice that may flip.
FP8_MARGIN = 0.2
FP8_LOGITS_REL = 0.15  # relative Frobenius error of prefill logits, fp8 vs bf16


@pytest.mark.gpu
def test_gpu_fp8_gives_the_bf16_greedy_tokens(make_checkpoint, tmp_path: Path) -> None:
    """32 greedy steps for 3 prompts through the engine (decode steps replay CUDA graphs),
    bf16 vs fp8, both on the GPU; prefill logits within FP8_LOGITS_REL."""
    from llmfleet.engine.engine import LLMEngine

    path = str(make_checkpoint("llama", tmp_path, hidden_size=256, intermediate_size=512))
    bf16 = load_model(path, dtype=torch.bfloat16, device="cuda", progress=False)
    fp8 = load_model(path, dtype=torch.bfloat16, device="cuda", quantization="fp8", progress=False)
    assert len(_fp8_modules(fp8.model)) == 4 * fp8.spec.num_layers and not _fp8_modules(bf16.model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 23, 61)]
    errs = [_rel_err(prefill_logits(fp8, p), prefill_logits(bf16, p)) for p in prompts]
    print(f"\nfp8 vs bf16 prefill logits, relative error: {[f'{e:.4f}' for e in errs]}")
    assert max(errs) < FP8_LOGITS_REL

    cfg = dict(device="cuda", dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64)
    engine = LLMEngine(EngineConfig(quantization="fp8", **cfg), fp8)
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    # The bandwidth metric counts the FP8 projections at a byte per weight (plus row scales).
    assert 1.0 < engine.model_shape.projection_weight_bytes < 1.02
    assert 1.0 < engine.model_shape.mlp_weight_bytes < 1.02
    assert engine.model_shape.weight_bytes == 2
    got = greedy_tokens(engine, prompts, 32)
    assert graphs.num_replays >= 31  # the decode steps ran from CUDA graphs
    ref = greedy_tokens(LLMEngine(EngineConfig(**cfg), bf16), prompts, 32)
    diverged = 0
    for prompt, a, b in zip(prompts, got, ref, strict=True):
        assert len(a) == len(b) == 32
        first = next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), None)
        if first is not None:
            diverged += 1
            margin = top2_margin(bf16, prompt + b[:first])
            assert margin < FP8_MARGIN, (first, margin, a, b)
    print(f"fp8 greedy tokens: {3 - diverged}/3 prompts identical over 32 steps")
