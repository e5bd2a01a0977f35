"""The fused rotary + KV cache write kernel against `rotary_embedding` then `kv_cache_write`
(bit for bit) and against its PyTorch reference; the attention backends' `rope=` path (a pure
decode step in the Triton backend: decode attention with the rotary and cache write folded
in, against the two launches it replaces).

Small-size tests run compiled on a CUDA machine and in Triton's interpreter on the CPU; the
`gpu` test runs at Llama-3-8B sizes with the cache poisoned with NaN.
"""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from tiny_models import PROMPT_LENS, Runner, assert_logits_close, random_prompts  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels.kv_cache_write import kv_cache_write  # noqa: E402
from llmfleet.kernels.rotary import (  # noqa: E402
    Llama3RopeScaling,
    build_cos_sin_cache,
    rotary_embedding,
)
from llmfleet.kernels.rotary_kv_write import (  # noqa: E402
    rotary_kv_cache_write,
    rotary_kv_cache_write_ref,
)
from llmfleet.models.attention.backend import AttentionBackend  # noqa: E402
from llmfleet.models.attention.metadata import AttentionMetadata  # noqa: E402
from llmfleet.models.attention.reference import TorchReferenceBackend  # noqa: E402
from llmfleet.models.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from llmfleet.models.loader import load_model  # noqa: E402
from llmfleet.models.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POSITION = 64
ATTN_TOL = 1e-5 if DEVICE == "cpu" else 5e-3  # compiled fp32 dots may use tf32


class Case:
    """One fused (T, (H + 2 Hkv) D) qkv activation with q, k, v as views of it, a paged cache,
    positions, slots (some -1) and a cos/sin table."""

    def __init__(
        self,
        num_tokens: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rot_dim: int,
        dtype: torch.dtype,
        device: str = DEVICE,
        num_blocks: int = 8,
        block_size: int = 4,
        seed: int = 0,
        cache_fill: float | None = None,  # None: random
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim = num_heads, num_kv_heads, head_dim
        width = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = torch.randn(num_tokens, width, generator=g).to(device=device, dtype=dtype)
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if cache_fill is None:
            self.kv_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        else:
            self.kv_cache = torch.full(shape, cache_fill, device=device, dtype=dtype)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        slots[::3] = -1  # every third token is padding
        self.slot_mapping = slots.to(device)
        # Positions >= 1 so that every row, padding included, really rotates.
        self.positions = torch.randint(1, MAX_POSITION, (num_tokens,), generator=g).to(device)
        self.cos_sin = build_cos_sin_cache(
            rot_dim, MAX_POSITION, 500000.0, Llama3RopeScaling(), device=device
        )

    def clone(self) -> Case:
        other = object.__new__(Case)
        other.__dict__.update(self.__dict__)
        other.qkv, other.kv_cache = self.qkv.clone(), self.kv_cache.clone()
        return other

    def qkv_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.qkv.shape[0]
        q, k, v = self.qkv.view(t, self.heads + 2 * self.kv_heads, self.dim).split(
            [self.heads, self.kv_heads, self.kv_heads], 1
        )
        return q, k, v

    def args(self) -> tuple[torch.Tensor, ...]:
        q, k, v = self.qkv_views()
        return self.positions, q, k, v, self.cos_sin, self.kv_cache, self.slot_mapping


def two_kernels(case: Case) -> None:
    positions, q, k, v, cos_sin, kv_cache, slots = case.args()
    rotary_embedding(positions, q, k, cos_sin)
    kv_cache_write(k, v, kv_cache, slots)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or broken)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------- small sizes


@pytest.mark.parametrize(
    "head_dim,rot_dim", [(64, 64), (64, 32), (128, 128), (128, 64), (80, 80), (80, 48)]
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_rotary_then_kv_write(
    head_dim: int, rot_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    base = Case(7, num_heads, num_kv_heads, head_dim, rot_dim, dtype)
    fused, split, ref = base.clone(), base.clone(), base.clone()
    rotary_kv_cache_write(*fused.args())
    two_kernels(split)
    rotary_kv_cache_write_ref(*ref.args())

    assert torch.equal(fused.qkv, split.qkv)  # q, k rotated alike, v untouched
    assert torch.equal(fused.kv_cache, split.kv_cache)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(fused.qkv, ref.qkv) < tol
    assert rel_err(fused.kv_cache, ref.kv_cache) < tol

    _, k, v = fused.qkv_views()
    _, k0, v0 = base.qkv_views()
    assert torch.equal(v, v0)
    assert torch.equal(k[:, :, rot_dim:], k0[:, :, rot_dim:])  # beyond rot_dim: untouched
    pad = base.slot_mapping < 0
    assert not torch.equal(k[pad], k0[pad])  # padding rows are rotated all the same
    # The cache holds the rotated k (its unrotated tail included) and v at each real slot,
    # and nothing else changed.
    flat = fused.kv_cache.view(2, -1, num_kv_heads, head_dim)
    expect = base.kv_cache.clone().view(2, -1, num_kv_heads, head_dim)
    real = base.slot_mapping[~pad]
    expect[0, real], expect[1, real] = k[~pad], v[~pad]
    assert torch.equal(flat, expect)


def test_full_kv_head_counts_and_block_sizes() -> None:
    # One kv head, and 16-token blocks: block and offset arithmetic of the slot.
    base = Case(11, 8, 1, 64, 64, torch.float32, num_blocks=3, block_size=16, seed=5)
    fused, split = base.clone(), base.clone()
    rotary_kv_cache_write(*fused.args())
    two_kernels(split)
    assert torch.equal(fused.qkv, split.qkv) and torch.equal(fused.kv_cache, split.kv_cache)


def test_no_tokens_is_a_no_op() -> None:
    base = Case(0, 4, 2, 64, 64, torch.float32)
    fused = base.clone()
    rotary_kv_cache_write(*fused.args())
    assert torch.equal(fused.kv_cache, base.kv_cache)


def test_dispatch_force_triton_and_reference() -> None:
    base = Case(5, 4, 2, 64, 32, torch.float32, seed=2)
    forced, ref = base.clone(), base.clone()
    dispatch.rotary_kv_cache_write(*forced.args(), force_triton=True)
    two_kernels(base)
    assert torch.equal(forced.qkv, base.qkv) and torch.equal(forced.kv_cache, base.kv_cache)
    if DEVICE == "cpu":  # without force_triton, CPU tensors take the reference
        dispatch.rotary_kv_cache_write(*ref.args())
        expect = Case(5, 4, 2, 64, 32, torch.float32, seed=2)
        rotary_kv_cache_write_ref(*expect.args())
        assert torch.equal(ref.qkv, expect.qkv) and torch.equal(ref.kv_cache, expect.kv_cache)


def _bad(name: str):
    """(argument index, replacement builder) for each check, by the name the error gives."""
    return {
        "positions": (0, lambda a: a[0][:-1]),
        "q/k": (1, lambda a: a[1][:, :, :32]),
        "k/v": (3, lambda a: a[3][:, :1]),
        "cos_sin_cache": (4, lambda a: torch.zeros(MAX_POSITION, 66)),
        "kv_cache must be": (5, lambda a: a[5][0]),
        "slot_mapping": (6, lambda a: a[6].int()),
    }[name]


@pytest.mark.parametrize(
    "name", ["positions", "q/k", "k/v", "cos_sin_cache", "kv_cache must be", "slot_mapping"]
)
@pytest.mark.parametrize("fn", [rotary_kv_cache_write, rotary_kv_cache_write_ref])
def test_bad_arguments_are_named(name: str, fn) -> None:
    case = Case(4, 4, 2, 64, 64, torch.float32)
    before = case.clone()
    args = list(case.args())
    i, make = _bad(name)
    args[i] = make(args)
    with pytest.raises(ValueError, match=name):
        fn(*args)
    assert torch.equal(case.qkv, before.qkv)  # checked before anything is rotated


@pytest.mark.parametrize("name", ["q", "v", "kv_cache"])
def test_non_unit_last_stride_is_named(name: str) -> None:
    case = Case(4, 4, 2, 64, 64, torch.float32)
    args = dict(
        zip(["positions", "q", "k", "v", "cos", "kv_cache", "slots"], case.args(), strict=True)
    )
    t = args[name]
    args[name] = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, column-major
    with pytest.raises(ValueError, match=f"^{name} must have unit stride"):
        rotary_kv_cache_write(*args.values())


# ----------------------------------------------------------------------------- backends


def _step(query_lens: list[int], seq_lens: list[int]):
    """Metadata of one step over 4-token blocks, its fused qkv (head_dim 32, 4 q / 2 kv heads),
    a random cache and the rotary inputs (rotary_dim 16: partial) at the tokens' positions."""
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, block_size = 4, 2, 32, 4
    tables, nxt = [], 1
    for s in seq_lens:
        nb = -(-s // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    qkv = torch.randn(meta.num_tokens, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE)
    cache = torch.randn(2, nxt, block_size, kv_heads, dim, generator=g).to(DEVICE)
    pos = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
    emb = RotaryEmbedding(16, MAX_POSITION, {"rope_type": "default", "rope_theta": 10000.0})
    rope = emb.at(torch.tensor(pos, device=DEVICE))
    return meta, qkv, cache, rope, (heads, kv_heads, dim)


def _split(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int):
    return qkv.view(qkv.shape[0], -1, dim).split([heads, kv_heads, kv_heads], 1)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_triton_backend_rope_equals_rotating_first(phase: str) -> None:
    if phase == "decode":
        meta, qkv, cache, rope, shape = _step([1, 1, 1], [3, 9, 14])
    else:  # a fresh prompt and a chunk over a cached prefix
        meta, qkv, cache, rope, shape = _step([3, 5], [3, 7])
    backend = TritonAttentionBackend(force_triton=True)
    qkv_a = qkv.clone()
    q, k, v = _split(qkv_a, *shape)
    cache_a = cache.clone()
    out_a = backend.forward(q, k, v, cache_a, meta, 0.2, rope=rope)
    if phase == "decode":  # one kernel, the rotation in registers: q and k stay as they were
        assert torch.equal(qkv_a, qkv)
    q, k, v = _split(qkv.clone(), *shape)
    dispatch.rotary_embedding(rope.positions, q, k, rope.table, force_triton=True)
    cache_b = cache.clone()
    out_b = backend.forward(q, k, v, cache_b, meta, 0.2)
    assert torch.equal(out_a, out_b) and torch.equal(cache_a, cache_b)

    q, k, v = _split(qkv.clone(), *shape)
    cache_c = cache.clone()
    out_c = TorchReferenceBackend().forward(q, k, v, cache_c, meta, 0.2, rope=rope)
    assert rel_err(out_a, out_c) < ATTN_TOL and rel_err(cache_a, cache_c) < 1e-6


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen3"])
def test_tiny_model_through_triton_backend_matches_reference(arch: str, make_checkpoint_module):
    """Prefill then a decode step of a tiny model (Qwen3: q/k norms before the rotation) with
    the rotation in the Triton backend's fused kernel, against the reference backend."""
    path = str(make_checkpoint_module(arch))
    logits = []
    for backend in (TritonAttentionBackend(force_triton=True), TorchReferenceBackend()):
        loaded = load_model(path, backend=backend, progress=False)
        prompts = random_prompts(loaded.spec.vocab_size)
        runner = Runner(loaded, PROMPT_LENS)
        first = runner.step([p[:-1] for p in prompts], [0, 0, 0])
        last = runner.step([p[-1:] for p in prompts], [n - 1 for n in PROMPT_LENS])
        logits.append(first + last)
    for ours, ref in zip(*logits, strict=True):
        assert_logits_close(ours, ref)


class _TwoLaunches(TritonAttentionBackend):
    """The Triton backend without the fused decode: rotary + KV write, then attention, on
    every step (the base class's `forward`)."""

    forward = AttentionBackend.forward


def test_tiny_model_fused_decode_equals_two_launches(make_checkpoint_module) -> None:
    """A prefill and two decode steps of a tiny Llama 3: the decode steps' logits through the
    fused decode kernel equal those of the two launches it replaces, bit for bit."""
    path = str(make_checkpoint_module("llama3_rope"))
    logits = []
    for backend in (TritonAttentionBackend(force_triton=True), _TwoLaunches(force_triton=True)):
        loaded = load_model(path, backend=backend, progress=False)
        prompts = random_prompts(loaded.spec.vocab_size)
        runner = Runner(loaded, PROMPT_LENS)
        steps = [runner.step([p[:-2] for p in prompts], [0, 0, 0])]
        for back in (2, 1):
            chunks = [p[-back : len(p) - back + 1] for p in prompts]
            steps.append(runner.step(chunks, [n - back for n in PROMPT_LENS]))
        logits.append([t for step in steps for t in step])
    for ours, before in zip(*logits, strict=True):
        assert torch.equal(ours, before)


# ----------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
def test_llama3_8b_decode_gpu() -> None:
    # 64 tokens, 32 q / 8 kv heads of 128, bf16, 16-token blocks; the cache is NaN except
    # where written.
    base = Case(
        64, 32, 8, 128, 128, torch.bfloat16, "cuda", num_blocks=64, block_size=16, seed=1,
        cache_fill=float("nan"),
    )  # fmt: skip
    base.cos_sin = build_cos_sin_cache(128, 131072, 500000.0, Llama3RopeScaling(), device="cuda")
    base.positions = torch.randint(0, 131072, (64,), device="cuda")
    fused, split, ref = base.clone(), base.clone(), base.clone()
    rotary_kv_cache_write(*fused.args())
    two_kernels(split)
    rotary_kv_cache_write_ref(*ref.args())
    torch.cuda.synchronize()

    assert torch.equal(fused.qkv, split.qkv)
    written = fused.slot_mapping[fused.slot_mapping >= 0]
    flat = fused.kv_cache.view(2, -1, 8, 128)
    flat_split = split.kv_cache.view(2, -1, 8, 128)
    flat_ref = ref.kv_cache.view(2, -1, 8, 128)
    assert torch.equal(flat[:, written], flat_split[:, written])
    assert rel_err(flat[:, written], flat_ref[:, written]) < 1e-2
    assert rel_err(fused.qkv, ref.qkv) < 1e-2
    others = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
    others[written] = False
    assert flat[:, others].isnan().all(), "slots not in slot_mapping must stay unwritten"
