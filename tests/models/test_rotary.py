"""The model's rotary path: on CUDA the Triton kernel rotates q and k in place inside the fused
qkv activations; elsewhere the reference rotates out of place. Both must agree."""

from __future__ import annotations

import pytest
import torch

from llmfleet.models.rotary import RotaryEmbedding, apply_rotary

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype, device) -> torch.Tensor:
    return torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device).to(dtype)


def _reference(qkv, rope, heads, kv_heads, dim):
    t = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * dim].float().view(t, heads + kv_heads, dim)
    cos, sin = rope.cos_sin()
    return apply_rotary(qk, cos, sin)


def test_cpu_rotate_is_the_reference_out_of_place() -> None:
    emb = RotaryEmbedding(64, 256, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = _qkv(5, 4, 2, 64, torch.float32, "cpu")
    before = qkv.clone()
    rope = emb.at(torch.tensor([0, 1, 7, 100, 255]))
    qk = qkv[:, : 6 * 64].view(5, 6, 64)
    q, k = rope.rotate(qk, 4)
    assert torch.equal(qkv, before)  # out of place on the CPU
    ref = _reference(before, rope, 4, 2, 64)
    assert torch.equal(torch.cat([q, k], dim=1), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_dim,params", [(128, LLAMA3), (64, {"rope_theta": 1e6})])
def test_cuda_rotate_in_place_matches_reference(dtype, rotary_dim, params) -> None:
    heads, kv_heads, dim, tokens = 32, 8, 128, 77
    emb = RotaryEmbedding(rotary_dim, 8192, {"rope_type": "default", **params})
    qkv = _qkv(tokens, heads, kv_heads, dim, dtype, "cuda")
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    rope = emb.at(positions)
    ref = _reference(qkv, rope, heads, kv_heads, dim)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    q, k = rope.rotate(qk, heads)
    torch.cuda.synchronize()
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place, inside qkv
    out = torch.cat([q, k], dim=1).float()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((out - ref).norm() / ref.norm()).item() < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched
