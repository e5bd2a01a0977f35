"""The skinny GEMM (kernels/skinny_gemm.py) against its float32 reference, and its selection.

Small sizes run compiled on a CUDA machine and in Triton's interpreter on the CPU: ragged M,
N and K, split-K with uneven splits, bias, strided rows of x. The `gpu` test runs Llama-3-8B's
projection shapes in bf16 at decode batch sizes on fresh data with the output poisoned.
"""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels import gemv as gv  # noqa: E402
from llmfleet.kernels import skinny_gemm as sg  # noqa: E402
from llmfleet.kernels.gemv import GemvConfig  # noqa: E402
from llmfleet.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from llmfleet.kernels.skinny_gemm import SkinnyConfig, skinny_gemm  # noqa: E402
from llmfleet.kernels.tuned_configs import TunedConfigs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return y if bias is None else y + bias.float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or broken)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def counters_armed() -> bool:
    return all(not c.any().item() for _, c in sg._WORKSPACE._by_device.values())


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (2, 64, 128, SkinnyConfig(32, 32)),  # one split
        (3, 100, 96, SkinnyConfig(32, 32, 3)),  # ragged N, three splits
        (16, 64, 200, SkinnyConfig(16, 64, 2)),  # K not a multiple of BLOCK_K
        (17, 48, 160, SkinnyConfig(16, 32, 3)),  # M just past a power of two; uneven split
        (64, 32, 64, SkinnyConfig(16, 16, 4)),  # the largest batch
        (5, 40, 96, SkinnyConfig(16, 32, 8)),  # more splits asked than steps: 3 run
        (4, 96, 256, None),  # the untuned default
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm_matches_reference(m, n, k, cfg, dtype, with_bias) -> None:
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if with_bias else None
    out = skinny_gemm(x, w, bias, cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, reference(x, w, bias)) < 1e-2  # 16-bit rounding of the output
    assert torch.equal(out, skinny_gemm(x, w, bias, cfg))  # splits added in a fixed order
    assert counters_armed()


@pytest.mark.parametrize(
    ("m", "inter", "k", "cfg"),
    [
        (2, 32, 128, SkinnyConfig(16, 32)),  # one split
        (3, 50, 96, SkinnyConfig(32, 32, 3)),  # ragged I, three splits
        (17, 24, 200, SkinnyConfig(16, 64, 2)),  # ragged K, uneven split
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_skinny_gemm_is_the_projection_then_silu_and_mul(m, inter, k, cfg, with_bias):
    """A fused [gate | up] weight: one kernel gives the SwiGLU with the bits of the GEMM (the
    same rows per program) followed by the `silu_and_mul` kernel, splits included."""
    torch.manual_seed(m * 1000 + inter + k)
    dtype = torch.bfloat16
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(2 * inter, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(2 * inter, device=DEVICE, dtype=dtype) if with_bias else None
    got = skinny_gemm(x, w, bias, cfg, gated=True)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul(skinny_gemm(x, w, bias, cfg)))
    ref = reference(x, w, bias).to(dtype).float()
    ref = F.silu(ref[:, :inter]) * ref[:, inter:]
    assert rel_err(got, ref) < 2e-2  # rounded twice
    assert torch.equal(got, skinny_gemm(x, w, bias, cfg, gated=True)) and counters_armed()


def test_float32_out_holds_the_rounded_result() -> None:
    x = torch.randn(5, 96, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(40, 96, device=DEVICE, dtype=torch.bfloat16)
    out = torch.full((5, 40), float("nan"), device=DEVICE)
    cfg = SkinnyConfig(16, 32, 2)
    assert skinny_gemm(x, w, None, cfg, out=out) is out
    assert torch.equal(out, skinny_gemm(x, w, None, cfg).float())
    with pytest.raises(ValueError, match="out must be"):
        skinny_gemm(x, w, None, cfg, out=torch.empty(5, 40, device=DEVICE, dtype=torch.float16))


def test_strided_rows_and_empty_shapes() -> None:
    x_big = torch.randn(6, 160, device=DEVICE, dtype=torch.bfloat16)
    x = x_big[:, :96]  # rows 160 apart
    w = torch.randn(40, 96, device=DEVICE, dtype=torch.bfloat16)
    out = skinny_gemm(x, w, None, SkinnyConfig(16, 32, 2))
    assert rel_err(out, reference(x, w, None)) < 1e-2
    assert skinny_gemm(x, w[:0]).shape == (6, 0)
    bias = torch.randn(40, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(skinny_gemm(x[:, :0], w[:, :0], bias), bias.expand(6, 40))
    assert not skinny_gemm(x[:, :0], w[:, :0]).any()  # K = 0: zeros
    gated = skinny_gemm(x[:, :0], w[:, :0], bias, gated=True)  # silu(bias_gate) * bias_up
    assert rel_err(gated, silu_and_mul(bias.expand(6, 40).contiguous())) < 1e-2


def test_bad_arguments_are_named() -> None:
    x = torch.randn(4, 16, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(8, 16, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        skinny_gemm(torch.randn(65, 16, device=DEVICE, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_gemm(x, w[:, :8])
    with pytest.raises(ValueError, match="16-bit dtype"):
        skinny_gemm(x.float(), w.float())
    with pytest.raises(ValueError, match="bias must be"):
        skinny_gemm(x, w, torch.randn(4, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit stride"):
        skinny_gemm(x, torch.randn(16, 8, device=DEVICE, dtype=torch.bfloat16).t())


def test_choose_reads_the_tuned_file_per_batch_bucket(tmp_path, monkeypatch) -> None:
    tuned = TunedConfigs("skinny_gemm", SkinnyConfig)
    tuned.directory = tmp_path
    tuned._names[0] = "NVIDIA H200"  # no CUDA call needed to name device 0
    monkeypatch.setattr(sg, "TUNED", tuned)
    cfg = SkinnyConfig(64, 256, 2, 4, 3)
    tuned.save("NVIDIA H200", torch.bfloat16, {(4096, 4096, 8): cfg, (6144, 4096, 8): None})
    gpu = torch.device("cuda", 0)
    assert [sg.m_bucket(m) for m in (2, 3, 5, 8, 9, 33, 64)] == [2, 4, 8, 8, 16, 64, 64]
    assert sg.choose(5, 4096, 4096, torch.bfloat16, gpu) == cfg  # 5 rows: the M = 8 entry
    assert sg.choose(5, 6144, 4096, torch.bfloat16, gpu) is None  # cuBLAS won there
    assert sg.choose(16, 4096, 4096, torch.bfloat16, gpu) is None  # not tuned: cuBLAS
    assert sg.choose(8, 4096, 4096, torch.float16, gpu) is None  # per dtype
    assert sg.choose(1, 4096, 4096, torch.bfloat16, gpu) is None  # one row: the GEMV
    assert sg.choose(8, 4096, 4096, torch.bfloat16, torch.device("cpu")) is None


def test_decode_linear_routes_by_batch(monkeypatch) -> None:
    """One row takes the GEMV; 2..64 rows the skinny GEMM where `choose` names a config, and
    `F.linear` where it does not."""
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(48, 64, device=DEVICE, dtype=torch.bfloat16)
    ran: list[SkinnyConfig] = []
    real = sg.skinny_gemm

    def spy(x, w, bias=None, config=None, **kwargs):
        ran.append(config)
        return real(x, w, bias, config, **kwargs)

    monkeypatch.setattr(sg, "skinny_gemm", spy)
    ref = reference(x, w, None)
    assert rel_err(dispatch.decode_linear(x, w, force_triton=True), ref) < 1e-2
    assert ran == []  # nothing tuned here: F.linear
    cfg = SkinnyConfig(16, 32, 2)
    monkeypatch.setattr(sg, "choose", lambda *args: cfg)
    assert rel_err(dispatch.decode_linear(x, w, force_triton=True), ref) < 1e-2
    assert ran == [cfg]
    one = dispatch.decode_linear(x[:1], w, force_triton=True)
    assert rel_err(one, ref[:1]) < 1e-2 and ran == [cfg]  # the GEMV
    assert torch.equal(dispatch.decode_linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    out = torch.empty(4, 48, device=DEVICE)
    assert dispatch.decode_linear(x, w, force_triton=True, out=out) is out  # float32 logits
    assert torch.equal(out, real(x, w, None, cfg).float())


def test_decode_gated_linear_routes_by_batch(monkeypatch) -> None:
    """The SwiGLU of a fused gate/up projection: one row in the gated GEMV, 2..64 rows in
    the gated skinny GEMM where its tuned file names a config, elsewhere the projection and
    then `silu_and_mul`; the same values every way."""
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(48, 64, device=DEVICE, dtype=torch.bfloat16)
    ref = reference(x, w, None).to(x.dtype).float()
    ref = F.silu(ref[:, :24]) * ref[:, 24:]
    ran: list[tuple[SkinnyConfig, bool]] = []
    real = sg.skinny_gemm

    def spy(x, w, bias=None, config=None, gated=False, **kwargs):
        ran.append((config, gated))
        return real(x, w, bias, config, gated=gated, **kwargs)

    monkeypatch.setattr(sg, "skinny_gemm", spy)
    assert rel_err(dispatch.decode_gated_linear(x, w, force_triton=True), ref) < 2e-2
    assert ran == []  # nothing tuned: F.linear, then silu_and_mul
    cfg = SkinnyConfig(16, 32, 2)
    monkeypatch.setattr(
        sg, "choose", lambda m, *args, gated=False: cfg if gated and m > 1 else None
    )
    assert rel_err(dispatch.decode_gated_linear(x, w, force_triton=True), ref) < 2e-2
    assert ran == [(cfg, True)]
    gemv_cfgs: list[GemvConfig] = []
    real_gemv = gv.gemv

    def gemv_spy(x, w, bias=None, config=None, **kwargs):
        gemv_cfgs.append(config)
        return real_gemv(x, w, bias, config, **kwargs)

    monkeypatch.setattr(gv, "gemv", gemv_spy)
    one = dispatch.decode_gated_linear(x[:1], w, force_triton=True)  # no GEMV entry: unfused
    assert rel_err(one, ref[:1]) < 2e-2 and len(ran) == 1 and gemv_cfgs == [None]
    cfg1 = GemvConfig(4, 32)
    monkeypatch.setattr(gv, "gated_config", lambda *args: cfg1)
    one = dispatch.decode_gated_linear(x[:1], w, force_triton=True)  # the gated GEMV
    assert rel_err(one, ref[:1]) < 2e-2 and len(ran) == 1 and gemv_cfgs == [None, cfg1]
    cpu = dispatch.decode_gated_linear(x.float(), w.float())  # off the GPU: the references
    assert (
        rel_err(cpu, F.silu(x.float() @ w[:24].float().t()) * (x.float() @ w[24:].float().t()))
        < 1e-5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 64])
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
)
def test_skinny_gemm_llama3_shapes_bf16(m: int, n: int, k: int) -> None:
    for _ in range(2):  # fresh data each time
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        torch.full((m, n), float("nan"), device="cuda")  # poison the allocator's next block
        got = skinny_gemm(x, w)
        assert rel_err(got, reference(x, w, None)) < 4e-3  # bf16 rounding of the output
        assert torch.equal(got, skinny_gemm(x, w))
        assert counters_armed()
        if n == 28672:  # the fused gate/up projection: with its SwiGLU too
            gated = skinny_gemm(x, w, gated=True)
            assert rel_err(gated, silu_and_mul(got)) < 8e-3
            assert torch.equal(gated, skinny_gemm(x, w, gated=True)) and counters_armed()
