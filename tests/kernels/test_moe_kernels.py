"""MoE routing, token alignment and fused MoE kernels against their PyTorch references.

Without CUDA the kernels run in Triton's CPU interpreter at small sizes. `triton.jit` reads
TRITON_INTERPRET when a kernel is *defined* (module import), not at launch, so the flag is set
here before the kernel modules are imported, and `test_kernels_run_in_interpreter` checks that
it took.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import fused_moe as fm  # noqa: E402
from llmfleet.kernels import moe_routing as mr  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


# Triton's CPU interpreter truncates float32 -> bfloat16 stores (the GPU rounds to nearest);
# three of them lie between x and out (inter, down, out), each biasing toward zero by up to
# 2**-8, so bfloat16 results get a looser bound there.
BF16_BOUND = 2e-2 if DEV == "cpu" else 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def test_kernels_run_in_interpreter() -> None:
    if torch.cuda.is_available():
        return
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (mr._topk_routing_kernel, mr._count_kernel, fm._moe_gemm_kernel):
        assert isinstance(kernel, InterpretedFunction)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 8, 1), (5, 128, 8), (20, 60, 6)])
def test_topk_routing(scoring: str, renormalize: bool, t: int, e: int, k: int) -> None:
    # float32 logits: bfloat16 ones tie often over 128 experts, and torch.topk orders ties
    # arbitrarily (the kernel takes the lowest index).
    logits = torch.randn(t, e, device=DEV)
    w, ids = mr.topk_routing(logits, k, renormalize, scoring)
    w_ref, ids_ref = mr.topk_routing_ref(logits, k, renormalize, scoring)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def _ids(t: int, e: int, k: int, used: int | None = None) -> torch.Tensor:
    """Random distinct experts per token drawn from the first `used` experts (others empty)."""
    used = used or e
    return torch.argsort(torch.rand(t, used), dim=1)[:, :k].to(torch.int32).to(DEV)


@pytest.mark.parametrize(
    "t,e,k,used,block_m",
    [
        (1, 8, 2, None, 16),
        (33, 8, 2, 5, 16),
        (7, 128, 8, None, 4),
        (300, 64, 8, 20, 64),
        (3, 4, 1, 1, 2),
        (16, 128, 8, None, 16),  # 128 slots: the most that one program sorts for 128 experts
        (40, 128, 8, 100, 16),  # 320 slots: the three-kernel path
    ],
)
def test_moe_align_block_size(t: int, e: int, k: int, used: int | None, block_m: int) -> None:
    ids = _ids(t, e, k, used)
    got = mr.moe_align_block_size(ids, e, block_m)
    want = mr.moe_align_block_size_ref(ids, e, block_m)
    n_pad = int(want[2])
    assert int(got[2]) == n_pad
    assert torch.equal(got[0][:n_pad], want[0][:n_pad])
    assert torch.equal(got[1][: n_pad // block_m], want[1][: n_pad // block_m])
    assert n_pad <= got[0].numel()


def _weights(e: int, h: int, inter: int, dtype: torch.dtype):
    w1 = torch.randn(e, 2 * inter, h, device=DEV, dtype=torch.float32) / h**0.5
    w2 = torch.randn(e, h, inter, device=DEV, dtype=torch.float32) / inter**0.5
    return w1, w2


def _fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=2) if per_channel else w.abs().amax(dim=(1, 2))
    scale = (amax / 448.0).float()
    s = scale[:, :, None] if per_channel else scale[:, None, None]
    return (w / s).to(FP8), scale


CASES = [
    # t, e, k, h, inter, used experts, config block sizes (M, N, K)
    (1, 8, 2, 64, 48, None, (16, 32, 32)),
    (13, 8, 2, 96, 40, 3, (16, 32, 64)),
    (9, 16, 8, 32, 24, None, (16, 16, 32)),
    (40, 6, 1, 48, 80, 4, (32, 64, 32)),
    (70, 4, 2, 32, 16, None, (16, 16, 32)),  # 140 slots: top-k summed by a separate kernel
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,e,k,h,inter,used,blocks", CASES)
def test_fused_moe(dtype, t, e, k, h, inter, used, blocks) -> None:
    w1, w2 = (w.to(dtype) for w in _weights(e, h, inter, dtype))
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    ids = _ids(t, e, k, used)
    tw = torch.softmax(torch.randn(t, k, device=DEV), dim=1)
    cfg = dict(zip(fm.CONFIG_KEYS, (*blocks, 2), strict=True))
    out = fm.fused_moe(x, w1, w2, tw, ids, config=cfg)
    ref = fm.fused_moe_ref(x, w1, w2, tw, ids)
    assert rel_err(out, ref) < (BF16_BOUND if dtype == torch.bfloat16 else 1e-2)
    if t * k <= fm.FUSED_SUM_MAX_SLOTS:  # the down kernel summed the top-k rows: re-armed
        _, counters = fm._COUNTERS.get(torch.device(DEV), 0, 0)
        assert int(counters.abs().max()) == 0


@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_moe_fp8(per_channel: bool) -> None:
    # FP8 W8A8 runs in the interpreter (its fp8 dot upcasts to float16, exact for e4m3).
    t, e, k, h, inter = 11, 8, 2, 64, 48
    w1, w2 = _weights(e, h, inter, torch.float32)
    (w1q, s1), (w2q, s2) = _fp8(w1, per_channel), _fp8(w2, per_channel)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    ids = _ids(t, e, k, 5)
    tw = torch.rand(t, k, device=DEV)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1)
    with fm.weight_tma(False):
        out = fm.fused_moe(x, w1q, w2q, tw, ids, s1, s2, config=cfg)
    ref = fm.fused_moe_ref(x, w1q, w2q, tw, ids, s1, s2)  # activations unquantized
    assert rel_err(out, ref) < 6e-2
    with fm.weight_tma(True):  # FP8 weight tiles through TMA descriptors: the same sums
        assert torch.equal(fm.fused_moe(x, w1q, w2q, tw, ids, s1, s2, config=cfg), out)


@pytest.mark.parametrize("t,e,k,h,inter,used,blocks", CASES)
def test_fused_moe_weight_tiles_through_tma_match_pointer_loads(t, e, k, h, inter, used, blocks):
    # The descriptor path zero-fills columns past K (h = 96 with BLOCK_K 64) and lets a tile
    # run into the next expert's rows (inter = 40, 80 with BLOCK_N 32, 64): the same sums.
    w1, w2 = (w.bfloat16() for w in _weights(e, h, inter, torch.bfloat16))
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    ids = _ids(t, e, k, used)
    tw = torch.softmax(torch.randn(t, k, device=DEV), dim=1)
    cfg = dict(zip(fm.CONFIG_KEYS, (*blocks, 2), strict=True))
    with fm.weight_tma(True):
        assert fm._weight_descriptor(w1, cfg) is not None
        via_tma = fm.fused_moe(x, w1, w2, tw, ids, config=cfg)
    with fm.weight_tma(False):
        assert fm._weight_descriptor(w1, cfg) is None
        via_pointers = fm.fused_moe(x, w1, w2, tw, ids, config=cfg)
    assert torch.equal(via_tma, via_pointers)


def test_weight_descriptor_only_for_layouts_tma_can_read() -> None:
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=1)
    w = torch.randn(4, 32, 64, device=DEV, dtype=torch.bfloat16)
    with fm.weight_tma(True):
        assert fm._weight_descriptor(w, cfg) is not None
        assert fm._weight_descriptor(w[:, :, :40], cfg) is None  # not contiguous
        assert fm._weight_descriptor(torch.zeros(4, 32, 36, dtype=torch.bfloat16), cfg) is None
        assert fm._weight_descriptor(w.to(FP8)[:, :, :40].contiguous(), cfg) is None  # 40 bytes
    with fm.weight_tma(False):
        assert fm._weight_descriptor(w, cfg) is None
    if DEV == "cpu":  # by default only NVIDIA sm_90 and later, compiled, take descriptors
        assert fm._weight_descriptor(w, cfg) is None


def test_fused_moe_one_token_with_a_repeated_expert() -> None:
    # One token gives each slot its own block, unsorted: a repeated expert is summed twice.
    e, h, inter = 4, 32, 16
    w1, w2 = (w.bfloat16() for w in _weights(e, h, inter, torch.bfloat16))
    x = torch.randn(1, h, device=DEV, dtype=torch.bfloat16)
    ids = torch.tensor([[2, 2, 0]], dtype=torch.int32, device=DEV)
    tw = torch.tensor([[0.5, 0.3, 0.2]], device=DEV)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=1)
    out = fm.fused_moe(x, w1, w2, tw, ids, config=cfg)
    assert rel_err(out, fm.fused_moe_ref(x, w1, w2, tw, ids)) < BF16_BOUND


def test_fused_moe_default_config_and_routing_end_to_end() -> None:
    t, e, k, h, inter = 5, 8, 2, 32, 32
    w1, w2 = (w.bfloat16() for w in _weights(e, h, inter, torch.bfloat16))
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    tw, ids = mr.topk_routing(torch.randn(t, e, device=DEV), k)
    out = fm.fused_moe(x, w1, w2, tw, ids)
    assert rel_err(out, fm.fused_moe_ref(x, w1, w2, tw, ids)) < BF16_BOUND


def test_pick_config_takes_the_nearest_entry_by_ratio_within_reach() -> None:
    full = {m: {"tuned_at": m} for m in (1, 16, 64, 512, 4096)}
    picked = {t: fm.pick_config(full, t, 8, 2).get("tuned_at") for t in
              (1, 4, 5, 32, 40, 200, 1500, 2000, 16384, 16385)}  # fmt: skip
    assert picked == {1: 1, 4: 1, 5: 16, 32: 16, 40: 64, 200: 512, 1500: 4096, 2000: 4096,
                      16384: 4096, 16385: None}  # fmt: skip
    assert fm.pick_config(full, 16385, 8, 2) == fm.default_config(16385, 8, 2)
    # A sparse table does not stretch its decode tile over M = 512, nor M = 1's over M = 8.
    sparse = {m: {"tuned_at": m} for m in (1, 64, 4096)}
    assert fm.pick_config(sparse, 512, 8, 2) == fm.default_config(512, 8, 2)
    assert fm.pick_config(sparse, 8, 8, 2) == fm.default_config(8, 8, 2)
    assert fm.pick_config(sparse, 16, 8, 2) == {"tuned_at": 64}
    assert fm.pick_config(None, 512, 8, 2) == fm.default_config(512, 8, 2)


def test_fused_moe_rejects_bad_shapes() -> None:
    w1, w2 = (w.bfloat16() for w in _weights(4, 32, 16, torch.bfloat16))
    x = torch.randn(2, 32, device=DEV, dtype=torch.bfloat16)
    tw, ids = mr.topk_routing(torch.randn(2, 4, device=DEV), 2)
    with pytest.raises(ValueError, match="w2"):
        fm.fused_moe(x, w1, w2[:, :, :8], tw, ids)
    with pytest.raises(ValueError, match="w1_scale"):
        fm.fused_moe(x, w1.to(FP8), w2.to(FP8), tw, ids)


def test_default_config_by_rows_per_expert() -> None:
    assert fm.default_config(1, 8, 2)["BLOCK_SIZE_M"] == 16
    assert fm.default_config(4096, 8, 2)["BLOCK_SIZE_M"] == 128


def test_shipped_tuned_configs_are_well_formed() -> None:
    """Every tuned file the package ships is found under its own name by `load_configs` and
    holds, per token count, a whole config of power-of-two tiles the kernel accepts."""
    files = sorted(fm.CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        fields = dict(part.split("=", 1) for part in path.stem.split(","))
        e, n, device, dtype = (fields[key] for key in ("E", "N", "device_name", "dtype"))
        assert dtype in ("bf16", "fp8_w8a8"), path.name
        assert fm.config_file_name(int(e), int(n), device.replace("_", " "), dtype) == path.name
        table = fm.load_configs(int(e), int(n), device.replace("_", " "), dtype)
        assert table and all(m >= 1 for m in table), path.name
        for cfg in table.values():
            assert set(cfg) == {*fm.CONFIG_KEYS, "num_warps", "num_stages"}, path.name
            for key in fm.CONFIG_KEYS[:3]:
                assert cfg[key] in (16, 32, 64, 128, 256), (path.name, cfg)
            assert cfg["num_warps"] in (4, 8) and 2 <= cfg["num_stages"] <= 5, (path.name, cfg)


def test_tuner_merges_new_sizes_into_the_existing_table() -> None:
    """Tuning a few more M keeps the sizes tuned before; a size tuned again takes the new
    config; the file lists M in numeric order (as `load_configs` reads it back)."""
    old = {"1": {"at": 1}, "512": {"at": 512}, "64": {"at": 64}}
    merged = fm.merge_config_tables(old, {"128": {"at": "new"}, "64": {"at": "new"}})
    assert list(merged) == ["1", "64", "128", "512"]
    assert merged == {"1": {"at": 1}, "64": {"at": "new"}, "128": {"at": "new"}, "512": {"at": 512}}
    with pytest.raises(ValueError, match="'big'"):
        fm.merge_config_tables({"big": {}}, {})


# ---- GPU, real sizes ----

MODELS = {"mixtral": (8, 2, 4096, 14336), "qwen3_30b_a3b": (128, 8, 2048, 768)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("t", [1, 16, 77, 512])
@pytest.mark.parametrize("quant", ["bf16", "fp8_tensor", "fp8_channel"])
def test_fused_moe_gpu(model: str, t: int, quant: str) -> None:
    e, k, h, inter = MODELS[model]
    torch.manual_seed(t)
    w1, w2 = _weights(e, h, inter, torch.float32)
    s1 = s2 = None
    if quant == "bf16":
        w1, w2 = w1.bfloat16(), w2.bfloat16()
    else:
        (w1, s1), (w2, s2) = _fp8(w1, quant == "fp8_channel"), _fp8(w2, quant == "fp8_channel")
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    tw, ids = mr.topk_routing(torch.randn(t, e, device=DEV), k)
    ref = fm.fused_moe_ref(x, w1, w2, tw, ids, s1, s2)
    out = fm.fused_moe(x, w1, w2, tw, ids, s1, s2)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < (1e-2 if quant == "bf16" else 6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(4096, 8, 2), (4096, 128, 8), (3, 128, 8)])
def test_routing_gpu(t: int, e: int, k: int) -> None:
    logits = torch.randn(t, e, device=DEV)
    w, ids = mr.topk_routing(logits, k)
    w_ref, ids_ref = mr.topk_routing_ref(logits, k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)
    sorted_ids = torch.full((mr.max_padded_rows(t * k, e, 64) + 64,), -7, device=DEV)
    got = mr.moe_align_block_size(ids, e, 64)
    want = mr.moe_align_block_size_ref(ids, e, 64)
    n_pad = int(want[2])
    assert int(got[2]) == n_pad and sorted_ids.numel() >= n_pad
    assert torch.equal(got[0][:n_pad], want[0][:n_pad])
    assert torch.equal(got[1][: n_pad // 64], want[1][: n_pad // 64])
