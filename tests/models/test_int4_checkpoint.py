"""AWQ and GPTQ checkpoints: their tensors, packed by an independent writer here from the
formats' public descriptions, load into our INT4 layout exactly.

CPU: the conversions against the dequantization formula; whole tiny checkpoints (AWQ, GPTQ
v1 and v2, GPTQ act order) give the logits of transformers' model holding the dequantized
weights; bad quantization configs fail naming the field. GPU (`-m gpu`): the same checkpoint
in bfloat16 keeps its projections packed (Int4Linear) and matches the dequantized model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import assert_logits_close, build_hf_model, make_tokenizer, prefill_logits

from llmfleet.models.int4_checkpoint import (
    Int4CheckpointFormat,
    awq_to_packed,
    checkpoint_format,
    dense_weight,
    gptq_to_packed,
)
from llmfleet.models.int4_linear import Int4Linear
from llmfleet.models.loader import load_model
from llmfleet.shared.core.errors import ModelLoadError

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # written independently of the loader's constant
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- an independent writer -----------------------------------------------------------------


def quantize(w: torch.Tensor, groups: np.ndarray, num_groups: int):
    """Asymmetric 4-bit min/max quantization of w (N, K) with input row k in group groups[k]:
    q (K, N) in 0..15, integer zero points z and scales s, both (num_groups, N)."""
    wt = w.t().double().numpy()  # (K, N)
    n = wt.shape[1]
    s = np.zeros((num_groups, n))
    z = np.zeros((num_groups, n), dtype=np.int64)
    for g in range(num_groups):
        rows = wt[groups == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        s[g] = np.maximum(hi - lo, 1e-8) / 15
        z[g] = np.clip(np.round(-lo / s[g]), 0, 15)
    s = s.astype(np.float16).astype(np.float64)  # checkpoints store fp16 scales
    q = np.clip(np.round(wt / s[groups]) + z[groups], 0, 15).astype(np.int64)
    return q, z, s


def dequantized(q, z, s, groups) -> torch.Tensor:
    """The weight (N, K) the quantized tensors stand for."""
    return torch.tensor(((q - z[groups]) * s[groups]).T, dtype=torch.float32)


def pack_words(x: np.ndarray, along_rows: bool, order=range(8)) -> torch.Tensor:
    """Pack nibbles 8 to an int32: along rows (row 8 i + order[j] at bits 4 j) or columns."""
    x = x.astype(np.uint64) if along_rows else x.T.astype(np.uint64)
    r, c = x.shape
    words = np.zeros((r // 8, c), dtype=np.uint64)
    for j, src in enumerate(order):
        words |= x[src::8] << np.uint64(4 * j)
    words = words.astype(np.uint32).view(np.int32)
    return torch.from_numpy(words if along_rows else words.T.copy())


def awq_tensors(w: torch.Tensor, group: int):
    k = w.shape[1]
    groups = np.arange(k) // group
    q, z, s = quantize(w, groups, k // group)
    return (
        {
            "qweight": pack_words(q, along_rows=False, order=AWQ_ORDER),  # (K, N // 8)
            "qzeros": pack_words(z, along_rows=False, order=AWQ_ORDER),  # (G, N // 8)
            "scales": torch.tensor(s, dtype=torch.float16),
        },
        dequantized(q, z, s, groups),
    )


def gptq_tensors(w: torch.Tensor, group: int, v1: bool, act_order: bool, seed: int = 0):
    k = w.shape[1]
    groups = np.arange(k) // group
    if act_order:  # GPTQ's desc_act: groups follow a permutation of the input rows
        groups = groups[np.random.default_rng(seed).permutation(k)]
    q, z, s = quantize(w, groups, k // group)
    # v1 ("gptq") stores z - 1 (symmetric quantization's 8 as 7); a zero point of 0 has no
    # v1 form (every reader adds 1 to the nibble), and min/max of N(0, 1) rows never gives one.
    assert not v1 or z.min() >= 1
    stored = z - 1 if v1 else z
    return (
        {
            "qweight": pack_words(q, along_rows=True),  # (K // 8, N)
            "qzeros": pack_words(stored, along_rows=False),  # (G, N // 8)
            "scales": torch.tensor(s, dtype=torch.float16),
            "g_idx": torch.tensor(groups, dtype=torch.int32),
        },
        dequantized(q, z, s, groups),
    )


def write_checkpoint(out: Path, method: str, group: int, **kw):
    """A tiny llama whose decoder projections are quantized; returns (path, the HF model
    holding the dequantized weights)."""
    hf = build_hf_model("llama", **kw.pop("overrides", {}))
    v1, act_order = kw.get("v1", True), kw.get("act_order", False)
    tensors = {}
    for name, p in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            if method == "awq":
                parts, deq = awq_tensors(p, group)
            else:
                parts, deq = gptq_tensors(p, group, v1, act_order, seed=len(tensors))
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
            with torch.no_grad():
                p.copy_(deq)
        else:
            tensors[name] = p.detach().clone().contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "awq":
        qc.update(version="gemm", zero_point=True)
    else:
        qc.update(desc_act=act_order, sym=False, checkpoint_format="gptq" if v1 else "gptq_v2")
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    make_tokenizer().save_pretrained(out)
    return out, hf


# ---- conversions -------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64])
def test_awq_layer_converts_exactly(group: int) -> None:
    w = torch.randn(48, 128)
    parts, ref = awq_tensors(w, group)
    packed = awq_to_packed("m", parts["qweight"], parts["qzeros"], parts["scales"].float(), group)
    assert packed.group_size == group
    assert torch.allclose(dense_weight(packed), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_layer_converts_exactly(v1: bool) -> None:
    w = torch.randn(40, 96)
    parts, ref = gptq_tensors(w, 32, v1, act_order=False)
    packed = gptq_to_packed(
        "m", parts["qweight"], parts["qzeros"], parts["scales"].float(), parts["g_idx"], 32, int(v1)
    )
    assert not isinstance(packed, torch.Tensor)
    assert torch.equal(packed.qweight, parts["qweight"])  # GPTQ's qweight is our layout
    assert torch.allclose(dense_weight(packed), ref, atol=1e-6, rtol=1e-6)


def test_gptq_act_order_layer_is_dequantized_by_its_g_idx() -> None:
    w = torch.randn(16, 64)
    parts, ref = gptq_tensors(w, 16, v1=True, act_order=True)
    dense = gptq_to_packed(
        "m", parts["qweight"], parts["qzeros"], parts["scales"].float(), parts["g_idx"], 16, 1
    )
    assert isinstance(dense, torch.Tensor)
    assert torch.allclose(dense, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "qc,field",
    [
        ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "checkpoint_format",
        ),
    ],
)
def test_unsupported_quantization_configs_name_the_field(qc: dict, field: str) -> None:
    class Config:
        quantization_config = qc

    with pytest.raises(ModelLoadError, match=field):
        checkpoint_format(Config())


def test_formats_read_from_configs() -> None:
    class Config:
        quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128}

    assert checkpoint_format(Config()) == Int4CheckpointFormat("gptq", 128, 1, False)
    assert checkpoint_format(object()) is None


# ---- whole checkpoints -------------------------------------------------------------------

CASES = {
    "awq": dict(method="awq"),
    "gptq": dict(method="gptq", v1=True),
    "gptq_v2": dict(method="gptq", v1=False),
    "gptq_act_order": dict(method="gptq", v1=True, act_order=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_loads_to_the_dequantized_model_on_cpu(tmp_path: Path, case: str) -> None:
    kw = dict(CASES[case])
    path, hf = write_checkpoint(tmp_path / case, kw.pop("method"), 32, **kw)
    loaded = load_model(str(path), dtype=torch.float32, progress=False)
    assert not any(isinstance(m, Int4Linear) for m in loaded.model.modules())  # CPU: dense
    ids = [5, 17, 99, 3, 42, 7, 250, 11]
    ours = prefill_logits(loaded, ids, device="cpu")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert_logits_close(ours, ref)


def test_checkpoint_missing_a_part_fails_naming_it(tmp_path: Path) -> None:
    path, _ = write_checkpoint(tmp_path / "awq", "awq", 32)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(str(path), dtype=torch.float32, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["awq", "gptq"])
def test_checkpoint_stays_packed_on_cuda(tmp_path: Path, case: str) -> None:
    kw = dict(CASES[case])
    overrides = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path, hf = write_checkpoint(tmp_path / case, kw.pop("method"), 128, overrides=overrides, **kw)
    loaded = load_model(str(path), dtype=torch.bfloat16, device="cuda", progress=False)
    packed = {
        n.rsplit(".", 1)[-1] for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)
    }
    assert packed == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    ids = list(range(3, 40))
    ours = prefill_logits(loaded, ids, device="cuda")
    with torch.no_grad():
        ref = hf.to("cuda", torch.bfloat16)(torch.tensor([ids], device="cuda")).logits[0].float()
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 0.02, err
