"""RMSNorm (+ residual), rotary embedding, SiLU-and-mul and the vocabulary-parallel embedding
lookup kernels against their references.

Small-size tests run compiled on a CUDA machine and in Triton's interpreter on the CPU; `gpu`
tests run at real model sizes on fresh random bf16 data with outputs poisoned with NaN.
"""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from llmfleet.kernels.rotary import (  # noqa: E402
    Llama3RopeScaling,
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)
from llmfleet.kernels.shard_embedding import shard_embedding, shard_embedding_ref  # noqa: E402
from llmfleet.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or broken)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------- small sizes


@pytest.mark.parametrize("hidden", [64, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    x = torch.randn(7, 2 * hidden, device=DEVICE, dtype=dtype)[:, :hidden]  # strided rows
    w = torch.randn(hidden, device=DEVICE, dtype=dtype)
    res = torch.randn(7, hidden, device=DEVICE, dtype=dtype) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, w, 1e-6, res)
    want = rms_norm_ref(x, w, 1e-6, res)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    if with_residual:
        assert rel_err(got[0], want[0]) < tol
        assert torch.equal(got[1], want[1])  # the residual sum is rounded identically
    else:
        assert rel_err(got, want) < tol
    assert torch.equal(x, x_before)


def test_rms_norm_ref_is_the_textbook_formula() -> None:
    x, w = torch.randn(3, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    expect = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5), expect)


@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (64, 32)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_rotary_matches_ref(head_dim: int, rot_dim: int, num_heads: int, num_kv_heads: int) -> None:
    num_tokens = 9
    cache = build_cos_sin_cache(rot_dim, 64, 500000.0, Llama3RopeScaling(), device=DEVICE)
    positions = torch.randint(0, 64, (num_tokens,), device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided views
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    rotary_embedding(positions, q, k, cache)
    assert rel_err(q, q_ref) < 1e-6 and rel_err(k, k_ref) < 1e-6
    v_part = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    assert not v_part.isnan().any()


def test_rotary_ref_rotates_by_position_and_keeps_norms() -> None:
    cache = build_cos_sin_cache(8, 16)
    q = torch.randn(2, 1, 8, dtype=torch.float64)
    k = q.clone()
    q0 = q.clone()
    rotary_embedding_ref(torch.tensor([0, 5]), q, k, cache.double())
    torch.testing.assert_close(q[0], q0[0])  # position 0 is the identity
    torch.testing.assert_close(q.norm(dim=-1), q0.norm(dim=-1))
    # Dimension pair (0, 4) at position 5 rotates by angle 5 * base^0 = 5 radians.
    c, s = torch.tensor(5.0, dtype=torch.float64).cos(), torch.tensor(5.0).double().sin()
    torch.testing.assert_close(q[1, 0, 0], q0[1, 0, 0] * c - q0[1, 0, 4] * s)


def test_llama3_scaling_slows_only_long_wavelengths() -> None:
    plain = build_cos_sin_cache(128, 2, 500000.0, dtype=torch.float64)
    scaled = build_cos_sin_cache(128, 2, 500000.0, Llama3RopeScaling(), dtype=torch.float64)
    angle_plain = torch.atan2(plain[1, 64:], plain[1, :64])  # position 1: angle = inv_freq
    angle_scaled = torch.atan2(scaled[1, 64:], scaled[1, :64])
    torch.testing.assert_close(angle_scaled[:10], angle_plain[:10])  # high frequencies kept
    torch.testing.assert_close(angle_scaled[-5:], angle_plain[-5:] / 8)  # low ones / factor


@pytest.mark.parametrize("inter", [64, 100, 1500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_ref(inter: int, dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * inter, device=DEVICE, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < tol


@pytest.mark.parametrize("hidden", [64, 1500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shard_embedding_takes_its_rows_and_zeros_the_rest(hidden: int, dtype) -> None:
    # Rows [40, 70) of a 100-id vocabulary: ids below, inside (both ends) and above.
    table = torch.randn(30, hidden, device=DEVICE).to(dtype)
    ids = torch.tensor([0, 39, 40, 55, 69, 70, 99, 41], device=DEVICE)
    got = shard_embedding(ids, table, 40)
    want = torch.zeros(len(ids), hidden, dtype=dtype, device=DEVICE)
    for t, i in enumerate(ids.tolist()):
        if 40 <= i < 70:
            want[t] = table[i - 40]
    assert torch.equal(got, want) and torch.equal(shard_embedding_ref(ids, table, 40), want)
    assert torch.equal(dispatch.shard_embedding(ids.int(), table, 40, force_triton=True), want)
    assert shard_embedding(ids[:0], table, 40).shape == (0, hidden)


def test_dispatch_small_ops_force_triton() -> None:
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    assert (
        rel_err(dispatch.rms_norm(x, w, 1e-6, force_triton=True), rms_norm_ref(x, w, 1e-6)) < 1e-6
    )
    y = torch.randn(4, 128, device=DEVICE)
    assert rel_err(dispatch.silu_and_mul(y, force_triton=True), silu_and_mul_ref(y)) < 1e-6


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_rms_norm_gpu(hidden: int) -> None:
    x = torch.randn(4099, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    got_out, got_res = rms_norm(x, w, 1e-5, res)
    want_out, want_res = rms_norm_ref(x, w, 1e-5, res)
    assert rel_err(got_out, want_out) < 1e-2 and torch.equal(got_res, want_res)
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)) < 1e-2


@pytest.mark.gpu
def test_rotary_gpu() -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 8192, 32, 8, 128
    cache = build_cos_sin_cache(head_dim, 131072, 500000.0, Llama3RopeScaling(), device="cuda")
    positions = torch.randint(0, 131072, (num_tokens,), device="cuda")
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cache)
    rotary_embedding(positions, q, k, cache)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(k, k_ref) < 1e-2


@pytest.mark.gpu
def test_silu_and_mul_gpu() -> None:
    x = torch.randn(4099, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < 1e-2
