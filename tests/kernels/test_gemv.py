"""The M = 1 GEMV (kernels/gemv.py) against its float32 reference and F.linear.

Small sizes run compiled on a CUDA machine and in Triton's interpreter on the CPU (ragged N
and K, block boundaries, bias); the `gpu` test runs Llama-3-8B's projection shapes in bf16 on
fresh data with the output poisoned.
"""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmfleet.kernels import gemv as gemv_module  # noqa: E402
from llmfleet.kernels.gemv import GemvConfig, gemv, gemv_ref  # noqa: E402
from llmfleet.kernels.silu_and_mul import silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or broken)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize(("n", "k"), [(1, 16), (37, 100), (64, 256), (130, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_ref_and_linear(n: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, 2 * k, generator=g).to(DEVICE, dtype)[:, :k]  # strided rows
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    # Blocks smaller than the shapes: several programs, K loop steps, a ragged last step.
    cfg = GemvConfig(block_n=8, block_k=32)
    got = gemv(x, w, bias, config=cfg)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert rel_err(got, gemv_ref(x, w, bias)) < tol
    assert (
        rel_err(got, F.linear(x.float(), w.float(), None if bias is None else bias.float())) < tol
    )
    assert rel_err(gemv(x, w, bias), gemv_ref(x, w, bias)) < tol  # the default blocks


@pytest.mark.parametrize(("inter", "k"), [(1, 16), (37, 100), (64, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_gemv_is_the_projection_then_silu_and_mul(
    inter: int, k: int, dtype: torch.dtype, with_bias: bool
) -> None:
    """A fused [gate | up] weight: one kernel gives the SwiGLU, with the same bits as the
    GEMV (same rows per program) followed by the `silu_and_mul` kernel."""
    g = torch.Generator().manual_seed(inter * 1000 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(2 * inter, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(2 * inter, generator=g).to(DEVICE, dtype) if with_bias else None
    cfg = GemvConfig(block_n=4, block_k=32)  # gated: 4 rows from each half per program
    got = gemv(x, w, bias, config=cfg, gated=True)
    assert got.shape == (1, inter) and got.dtype == dtype
    unfused = silu_and_mul(gemv(x, w, bias, config=cfg))
    assert torch.equal(got, unfused)
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert rel_err(got, gemv_ref(x, w, bias, gated=True)) < tol
    assert rel_err(gemv(x, w, bias, gated=True), gemv_ref(x, w, bias, gated=True)) < tol


@pytest.mark.parametrize(("n", "k"), [(37, 20), (64, 256), (130, 72)])
@pytest.mark.parametrize("gated", [False, True])
def test_a_parameter_weight_read_before_the_wait_gives_the_same_bits(
    n: int, k: int, gated: bool
) -> None:
    """A model parameter's first tile is read before the kernel waits on its predecessor
    (compiled with PDL on sm_90); the result is that of a plain tensor's launch, behind a
    kernel that writes x, so x is read only after that write."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(2 * n, k, generator=g).to(DEVICE, torch.float16)
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    cfg = GemvConfig(block_n=4, block_k=32)
    x0 = torch.randn(1, k, generator=g).to(DEVICE, torch.float16)
    x = torch.empty_like(x0)
    for _ in range(3):
        x.copy_(x0)  # the previous kernel: x is its output
        got = gemv(x, param, config=cfg, gated=gated)
        x.copy_(x0)
        want = gemv(x, w, config=cfg, gated=gated)
        assert torch.equal(got, want)
    assert rel_err(got, gemv_ref(x0, w, gated=gated)) < 4e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_out_holds_the_rounded_result(dtype: torch.dtype) -> None:
    """The output head writing the sampler's float32 logits: the values of `.float()` of the
    16-bit result, written into the caller's tensor."""
    x = torch.randn(1, 96, device=DEVICE).to(dtype)
    w = torch.randn(50, 96, device=DEVICE).to(dtype)
    out = torch.full((1, 50), float("nan"), device=DEVICE)
    cfg = GemvConfig(block_n=8, block_k=32)
    assert gemv(x, w, config=cfg, out=out) is out
    assert torch.equal(out, gemv(x, w, config=cfg).float())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, config=cfg, out=torch.empty(1, 49, device=DEVICE))
    assert not gemv(x[:, :0], w[:, :0], out=out).any()  # K = 0: zeros
    with pytest.raises(ValueError, match="out must be"):  # gated: x's dtype only
        gemv(x, w[:48], config=cfg, gated=True, out=torch.empty(1, 24, device=DEVICE))


def test_gemv_rejects_what_it_cannot_serve() -> None:
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \(1, K\)"):
        gemv(x, torch.randn(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        gemv(x[:1], torch.randn(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemv(x[:1], torch.randn(4, 16, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        gemv(x[:1], torch.randn(16, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="gated weight must have 2 . I rows"):
        gemv(x[:1], torch.randn(5, 16, device=DEVICE), gated=True)


def test_untuned_default_off_cuda() -> None:
    cpu = torch.device("cpu")  # nothing tuned to look up
    assert gemv_module.get_config(6144, 4096, torch.bfloat16, cpu) == GemvConfig(8, 512, 4, 1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
)
def test_gemv_llama3_shapes_bf16(n: int, k: int) -> None:
    for _ in range(2):  # fresh data each time
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        torch.full((1, n), float("nan"), device="cuda")  # poison the allocator's next block
        got = gemv(x, w)
        assert rel_err(got, gemv_ref(x, w)) < 4e-3  # bf16 rounding of the output
        if n == 28672:  # the fused gate/up projection: with its SwiGLU too
            gated = gemv(x, w, gated=True)
            assert rel_err(gated, gemv_ref(x, w, gated=True)) < 8e-3  # rounded twice
            assert rel_err(gated, silu_and_mul(got)) < 8e-3
