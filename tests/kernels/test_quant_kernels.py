"""Quantization, scaled GEMM and INT4 GEMM kernels against their PyTorch references.

Without CUDA the kernels run in Triton's CPU interpreter at small sizes. `triton.jit` reads
TRITON_INTERPRET when a kernel is *defined* (module import), not at launch, so the flag is set
here before the kernel modules are imported, and `test_kernels_run_in_interpreter` checks that
it took (a module imported earlier without it would hold compiled-GPU kernels).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from llmfleet.kernels import int4_gemv as gv  # noqa: E402
from llmfleet.kernels import int4_matmul as i4  # noqa: E402
from llmfleet.kernels import int4_pack as ip  # noqa: E402
from llmfleet.kernels import quant, scaled_mm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or overflowed elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def test_kernels_run_in_interpreter() -> None:
    if torch.cuda.is_available():
        return
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (
        quant._per_token_quant_kernel,
        scaled_mm._scaled_mm_kernel,
        i4._int4_matmul_kernel,
        gv._int4_gemv_fma_kernel,
        gv._int4_gemv_dot_kernel,
    ):
        assert isinstance(kernel, InterpretedFunction)


# ---- quant ----


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("m,k", [(1, 16), (5, 100), (3, 9000)])
def test_per_token_quant(dtype: torch.dtype, m: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 100_003 + k)  # the same input in any test order
    x = (torch.randn(m, k, generator=g) * 3).to(device=DEV, dtype=torch.bfloat16)
    x[0, 0] = 0.0
    q, s = quant.per_token_quant(x, dtype)
    q_ref, s_ref = quant.per_token_quant_ref(x, dtype)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # Same function: identical codes except near a rounding tie (the two sides may compute
    # x * (QMAX / absmax) with different rounding; about 1% of FP8 codes at k=9000), and then
    # only by one step (checked below for every code).
    diff = q.float() != q_ref.float()
    assert diff.float().mean().item() < 3e-2
    step = q_ref.float().abs().clamp_min(2**-6) / 4 if dtype == FP8 else 1.0
    assert ((q.float() - q_ref.float()).abs() <= step).all()
    assert rel_err(q.float() * s, x.float()) < (0.04 if dtype == FP8 else 0.01)


def test_per_token_quant_zero_row_and_strided_input() -> None:
    big = torch.randn(4, 64, device=DEV, dtype=torch.float16)
    big[2] = 0.0
    x = big[:, :48]  # row stride 64
    q, s = quant.per_token_quant(x, torch.int8)
    q_ref, s_ref = quant.per_token_quant_ref(x, torch.int8)
    assert torch.equal(q, q_ref)
    assert torch.isfinite(s).all() and (q[2] == 0).all()


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
def test_static_quant(dtype: torch.dtype) -> None:
    x = torch.randn(7, 1500, device=DEV, dtype=torch.float32) * 5
    scale = torch.tensor([0.02], device=DEV)  # saturates the tails
    q = quant.static_quant(x, scale, dtype)
    q_ref = quant.static_quant_ref(x, scale, dtype)
    assert (q.float() != q_ref.float()).float().mean().item() < 1e-3
    assert q.float().abs().max().item() == quant._QMAX[dtype]


def test_quant_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        quant.per_token_quant(torch.randn(2, 4, device=DEV), torch.float16)
    with pytest.raises(ValueError, match="2-D"):
        quant.per_token_quant(torch.randn(4, device=DEV))


# ---- scaled_mm ----


def _quantized_pair(m: int, n: int, k: int, dtype: torch.dtype, per_channel: bool):
    a, b = torch.randn(m, k, device=DEV), torch.randn(n, k, device=DEV)
    a_q, a_s = quant.per_token_quant(a, dtype)
    if per_channel:
        b_q, b_s = quant.per_token_quant(b, dtype)
    else:
        b_s = (b.abs().max() / quant._QMAX[dtype]).reshape(1).float()
        b_q = quant.static_quant(b, b_s, dtype)
    return a_q, a_s, b_q, b_s


@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize(
    "m,n,k,per_channel,split",
    [(1, 40, 96, True, 1), (17, 72, 200, False, 1), (33, 16, 64, True, 2), (2, 48, 520, False, 4)],
)
def test_scaled_mm(dtype, m, n, k, per_channel, split) -> None:
    a_q, a_s, b_q, b_s = _quantized_pair(m, n, k, dtype, per_channel)
    cfg = scaled_mm.MatmulConfig(16, 32, 64, split_k=split, group_m=2)
    out_dtype = torch.float16 if m % 2 else torch.bfloat16
    out = scaled_mm.scaled_mm(a_q, b_q, a_s, b_s, out_dtype, config=cfg)
    ref = scaled_mm.scaled_mm_ref(a_q, b_q, a_s, b_s, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert rel_err(out, ref) < 1e-2


def test_scaled_mm_default_config_small() -> None:
    a_q, a_s, b_q, b_s = _quantized_pair(3, 24, 1024, torch.int8, True)
    out = scaled_mm.scaled_mm(a_q, b_q, a_s, b_s)
    assert rel_err(out, scaled_mm.scaled_mm_ref(a_q, b_q, a_s, b_s)) < 1e-2


def test_scaled_mm_wide_tiles_on_hopper_for_few_rows_and_many_columns() -> None:
    wide = scaled_mm.MatmulConfig(16, 128, 256, split_k=1, num_warps=4, num_stages=3)
    assert scaled_mm.default_config(1, 14336, 4096, wide_tiles=True) == wide
    assert scaled_mm.default_config(8, 8448, 14336, wide_tiles=True) == wide
    # 16 rows, fewer columns than 132 tiles of 64, or no Hopper: the 64-column tile
    for m, n, wide_tiles in [(16, 14336, True), (1, 4096, True), (1, 14336, False)]:
        assert scaled_mm.default_config(m, n, 4096, wide_tiles).block_n == 64
    # the wide tile itself on ragged N and K (partial column tiles, a partial K block)
    a_q, a_s, b_q, b_s = _quantized_pair(3, 200, 328, FP8, True)
    out = scaled_mm.scaled_mm(a_q, b_q, a_s, b_s, config=wide)
    assert rel_err(out, scaled_mm.scaled_mm_ref(a_q, b_q, a_s, b_s)) < 1e-2


def test_scaled_mm_rejects_mismatched_dtypes() -> None:
    a_q, a_s, b_q, b_s = _quantized_pair(2, 16, 32, torch.int8, True)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        scaled_mm.scaled_mm(a_q, b_q.to(torch.float32).to(FP8), a_s, b_s)


# ---- int4 ----


def _random_int4(k: int, n: int, group: int, dtype: torch.dtype):
    q = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    scales = (torch.rand(k // group, n) * 0.02 + 0.005).to(dtype)
    zeros = (torch.randint(0, 16, (k // group, n)).float() * scales.float()).to(dtype)
    return ip.pack_int4(q).to(DEV), scales.to(DEV), zeros.to(DEV), q


def test_pack_unpack_roundtrip() -> None:
    q = torch.randint(0, 16, (64, 5), dtype=torch.uint8)
    packed = ip.pack_int4(q)
    assert packed.shape == (8, 5) and packed.dtype == torch.int32
    assert torch.equal(ip.unpack_int4(packed), q)
    # Nibble j of word i is row 8 i + j, lowest nibble first.
    assert (int(packed[0, 0]) & 0xF) == q[0, 0] and ((int(packed[0, 0]) >> 28) & 0xF) == q[7, 0]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_pack_gguf_matches_gguf_dequantize(qtype: str) -> None:
    import gguf  # a CPU-side dependency; the GPU image lacks it

    t = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)  # (N, K)
    w[3, :32] = 0.5  # a constant block: Q4_1 has d == 0 there
    blocks = gguf.quants.quantize(w, t)
    expected = gguf.quants.dequantize(blocks, t)  # (N, K) float32
    pack = ip.pack_gguf_q4_0 if qtype == "Q4_0" else ip.pack_gguf_q4_1
    qweight, scales, zeros = pack(blocks)
    got = ip.dequantize_int4(qweight, scales, zeros, 32)  # (K, N)
    np.testing.assert_allclose(got.t().numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("by_load", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,group,block_k,split",
    [
        (1, 40, 128, 32, 64, 1),
        (3, 72, 256, 64, 32, 2),
        (17, 24, 384, 128, 256, 1),
        (5, 16, 256, 32, 32, 4),
    ],
)
def test_int4_matmul(by_load, dtype, m, n, k, group, block_k, split) -> None:
    qweight, scales, zeros, _ = _random_int4(k, n, group, dtype)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    cfg = i4.Int4Config(16, 32, block_k, split_k=split, unpack_by_load=by_load)
    out = i4.int4_matmul(x, qweight, scales, zeros, group, config=cfg)
    ref = ip.int4_matmul_ref(x, qweight, scales, zeros, group)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m", [17, 24, 32])
def test_int4_matmul_default_runs_batches_past_16_rows_as_gemv_chunks(m, monkeypatch) -> None:
    """Up to `gemv_chunks_up_to` rows, the default path is 16-row `int4_gemv` calls writing
    their rows of one output in place (the last chunk ragged): every row equals the reference
    and each chunk went to the decode kernel."""
    qweight, scales, zeros, _ = _random_int4(256, 40, 32, torch.bfloat16)
    x = torch.randn(m, 256, device=DEV, dtype=torch.bfloat16)
    assert m <= i4.gemv_chunks_up_to(40, 256)
    calls = []
    gemv = i4.int4_gemv
    monkeypatch.setattr(
        i4, "int4_gemv", lambda x, *a, **kw: calls.append(len(x)) or gemv(x, *a, **kw)
    )
    out = i4.int4_matmul(x, qweight, scales, zeros, 32)
    assert calls == [16, m - 16]
    assert out.shape == (m, 40)
    assert rel_err(out, ip.int4_matmul_ref(x, qweight, scales, zeros, 32)) < 1e-2


def test_int4_gemv_chunks_reach_48_rows_for_8b_sized_weights() -> None:
    assert i4.gemv_chunks_up_to(576, 576) == 32  # SmolLM2's projections
    assert i4.gemv_chunks_up_to(4096, 4096) == 48  # Llama-3-8B's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,group,block_n,block_kp,split,dot",
    [
        (1, 40, 128, 32, 32, 4, 1, False),  # ragged N, steps inside one group
        (1, 72, 512, 128, 64, 4, 3, False),  # split not dividing the steps
        (1, 33, 96, 32, 16, 8, 4, False),  # odd N; block_kp spans groups; an empty split
        (3, 40, 256, 64, 32, 16, 1, True),
        (5, 24, 384, 128, 16, 16, 2, True),  # the last step is partial (48 packed rows)
        (16, 48, 512, 32, 32, 16, 3, True),
        (7, 40, 128, 128, 32, 4, 2, True),  # the step inside one group: scales per column
        (2, 56, 192, 64, 64, 2, 5, True),  # 16 k per step; 12 steps in shares of 3: one empty
        (1, 40, 128, 32, 32, 2, 1, True),  # the tensor-core kernel also serves M == 1
    ],
)
def test_int4_gemv(dtype, m, n, k, group, block_n, block_kp, split, dot) -> None:
    """The decode kernels against the float32 reference, including ragged N, K steps that are
    cut short, splits that get no work, and groups smaller than a step; the split-K
    workspace must be back to zeros afterwards (the next call relies on it)."""
    qweight, scales, zeros, _ = _random_int4(k, n, group, dtype)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    cfg = gv.GemvConfig(block_n, block_kp, split, dot)
    out = gv.int4_gemv(x, qweight, scales, zeros, group, config=cfg)
    exact = x.float() @ ip.dequantize_int4(qweight, scales, zeros, group)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, exact) < (2e-3 if dtype == torch.float16 else 1e-2)
    ws, counters = gv._WORKSPACE.get(torch.device(DEV), 0, 0)
    assert ws.abs().max().item() == 0 and counters.abs().max().item() == 0


@pytest.mark.parametrize(
    "n,k,group,block_n,block_kp,split",
    [(40, 128, 32, 32, 4, 1), (72, 512, 128, 64, 4, 3), (33, 96, 32, 16, 8, 4)],
)
def test_int4_gemv_packed_bf16(n, k, group, block_n, block_kp, split) -> None:
    """M == 1 with bf16x2 products (on the CPU the kernel's float32 emulation of them): same
    indexing, masks, splits and workspace re-arming as the float32 path."""
    qweight, scales, zeros, _ = _random_int4(k, n, group, torch.bfloat16)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    cfg = gv.GemvConfig(block_n, block_kp, split, False, packed=True)
    out = gv.int4_gemv(x, qweight, scales, zeros, group, config=cfg)
    exact = x.float() @ ip.dequantize_int4(qweight, scales, zeros, group)
    assert rel_err(out, exact) < 1e-2
    ws, counters = gv._WORKSPACE.get(torch.device(DEV), 0, 0)
    assert ws.abs().max().item() == 0 and counters.abs().max().item() == 0


def test_int4_matmul_small_m_takes_the_decode_kernel() -> None:
    qweight, scales, zeros, _ = _random_int4(256, 24, 64, torch.bfloat16)
    for m in (1, 2):
        x = torch.randn(m, 256, device=DEV, dtype=torch.bfloat16)
        out = i4.int4_matmul(x, qweight, scales, zeros, 64)
        assert rel_err(out, ip.int4_matmul_ref(x, qweight, scales, zeros, 64)) < 1e-2
    cfg = gv.default_gemv_config(1, 24, 256, 64)
    assert not cfg.dot and gv.default_gemv_config(2, 24, 256, 64).dot
    with pytest.raises(ValueError, match="M == 1"):
        gv.int4_gemv(x, qweight, scales, zeros, 64, config=cfg)


def test_int4_matmul_gguf_q4_0_end_to_end() -> None:
    import gguf

    w = np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)
    t = gguf.GGMLQuantizationType.Q4_0
    blocks = gguf.quants.quantize(w, t)
    qweight, scales, zeros = (p.to(DEV) for p in ip.pack_gguf_q4_0(blocks))
    x = torch.randn(2, 128, device=DEV, dtype=torch.float16)
    out = i4.int4_matmul(x, qweight, scales, zeros, 32)
    ref = x.float() @ torch.from_numpy(gguf.quants.dequantize(blocks, t)).to(DEV).t()
    assert rel_err(out, ref) < 1e-2


def test_int4_rejects_bad_group() -> None:
    qweight, scales, zeros, _ = _random_int4(64, 8, 32, torch.float16)
    with pytest.raises(ValueError, match="group_size"):
        i4.int4_matmul(torch.randn(1, 64, device=DEV).half(), qweight, scales, zeros, 16)


# ---- GPU, real sizes ----


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, torch.int8])
@pytest.mark.parametrize("m", [1, 16, 64, 333, 4096])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336)])
def test_scaled_mm_gpu(dtype, m, n, k) -> None:
    torch.manual_seed(m * 7 + n)
    a_q, a_s, b_q, b_s = _quantized_pair(m, n, k, dtype, per_channel=m % 2 == 0)
    ref = scaled_mm.scaled_mm_ref(a_q, b_q, a_s, b_s).float()
    out = scaled_mm.scaled_mm(a_q, b_q, a_s, b_s)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1e-2
    q, s = quant.per_token_quant(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), dtype)
    assert torch.isfinite(s).all() and q.shape == (m, k)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 4, 16, 128, 1000])
@pytest.mark.parametrize("n,k", [(14336, 4096), (4096, 14336)])
def test_int4_matmul_gpu(group, m, n, k) -> None:
    torch.manual_seed(group + m)
    dtype = torch.float16 if m == 4 else torch.bfloat16
    qweight, scales, zeros, _ = _random_int4(k, n, group, dtype)
    for _ in range(2):  # fresh activations; split-K partial sums must not leak between calls
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        ref = ip.int4_matmul_ref(x, qweight, scales, zeros, group)
        out = i4.int4_matmul(x, qweight, scales, zeros, group)
        assert rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-2)
    ws, counters = gv._WORKSPACE.get(torch.device(DEV), 0, 0)
    assert ws.abs().max().item() == 0 and counters.abs().max().item() == 0
