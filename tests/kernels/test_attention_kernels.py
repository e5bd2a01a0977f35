"""Paged attention and KV-cache write kernels against their PyTorch references; decode
attention with the rotary and the cache write folded in against the two kernels it replaces.

Small-size tests run everywhere: compiled on a CUDA machine, in Triton's interpreter on the
CPU. `gpu` tests run the compiled kernels at real sizes on fresh random bf16 data, with outputs
poisoned with NaN before each run.
"""

from __future__ import annotations

import dataclasses
import os
import random

import torch

# Triton picks interpreter or compiler when `@triton.jit` runs, and triton.language's own jit
# helpers (tl.zeros, tl.sum, tl.max, ...) are decorated at `import triton` (checked on triton
# 3.9): on a CPU-only machine the flag must be set before anything imports triton. The
# launchers re-read it at launch for our own kernels (`triton_utils.launchable`).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import dispatch  # noqa: E402
from llmfleet.kernels.kv_cache_write import kv_cache_write, kv_cache_write_ref  # noqa: E402
from llmfleet.kernels.paged_attention_decode import (  # noqa: E402
    DecodeConfig,
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_rope,
    paged_attention_decode_rope_ref,
)
from llmfleet.kernels.paged_attention_prefill import (  # noqa: E402
    PrefillConfig,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)
from llmfleet.kernels.rotary import build_cos_sin_cache  # noqa: E402
from llmfleet.kernels.rotary_kv_write import rotary_kv_cache_write  # noqa: E402
from llmfleet.models.attention.metadata import AttentionMetadata  # noqa: E402
from llmfleet.models.attention.triton_backend import TritonAttentionBackend  # noqa: E402

SMALL_DECODE = DecodeConfig(block_n=16, num_warps=1, num_stages=1)
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 tolerance: exact-ish in the interpreter, tf32 tensor cores when compiled.
FP32_TOL = 1e-5 if DEVICE == "cpu" else 5e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or broken)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class PagedBatch:
    """A random paged cache holding `seq_lens` tokens per sequence in shuffled blocks."""

    def __init__(
        self,
        seq_lens: list[int],
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        spare_blocks: int = 3,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], 0
        for nb in blocks_per_seq:
            tables.append(ids[used : used + nb])
            used += nb
        width = max(blocks_per_seq) + 1  # one padding column: must never be read
        self.block_tables = torch.tensor(
            [t + [ids[-1]] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        )
        self.tables = tables
        self.kv_cache = torch.randn(
            (2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen
        ).to(device=device, dtype=dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_seq_len = max(seq_lens)
        self.block_size = block_size


# ----------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("partition_size", [None, 32])
def test_decode_matches_ref(group: int, partition_size: int | None) -> None:
    num_kv_heads, head_dim = 2, 64
    lens = [1, 15, 16, 17, 47, 80]  # around block (16) and tile boundaries
    batch = PagedBatch(lens, num_kv_heads, head_dim, 16, torch.float32, DEVICE, seed=group)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEVICE)
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1, partition_size=partition_size)
    args = (q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125, batch.max_seq_len)
    out = paged_attention_decode(*args, out=torch.full_like(q, float("nan")), config=cfg)
    assert rel_err(out, paged_attention_decode_ref(*args)) < FP32_TOL


@pytest.mark.parametrize("num_sms,bound", [(6, 80), (6, 512), (64, 512)])
def test_decode_spreads_each_sequence_over_a_grid_sized_for_a_bound(
    monkeypatch: pytest.MonkeyPatch, num_sms: int, bound: int
) -> None:
    """As in a CUDA graph: the grid is sized for `bound` (>= every length), and each sequence
    spreads its own length over the partitions (2 of 48 + 32 tokens for length 80 when only
    2 are wanted: 6 SMs, 12 programs; one 16-token tile each when many are)."""
    import llmfleet.kernels.paged_attention_decode as decode

    monkeypatch.setattr(decode, "_num_sms", lambda device: num_sms)
    lens = [1, 15, 16, 17, 47, 80]
    batch = PagedBatch(lens, 2, 64, 16, torch.float32, DEVICE, seed=num_sms + bound)
    q = torch.randn(len(lens), 4, 64, device=DEVICE)
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1, min_partition=16)
    args = (q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125)
    out = paged_attention_decode(*args, bound, out=torch.full_like(q, float("nan")), config=cfg)
    assert rel_err(out, paged_attention_decode_ref(*args, batch.max_seq_len)) < FP32_TOL


def test_the_last_program_combines_as_the_reduction_kernel_does() -> None:
    """Split contexts combined by the last program of each (sequence, KV head) to finish,
    launch after launch (the counters re-arm), against the second reduction kernel; short
    sequences in a grid sized for a long bound leave most partitions empty."""
    import llmfleet.kernels.decode_partitions as decode_partitions

    lens = [1, 15, 16, 17, 47, 80, 200]
    batch = PagedBatch(lens, 2, 64, 16, torch.float32, DEVICE, seed=11)
    q = torch.randn(len(lens), 8, 64, device=DEVICE)
    args = (q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125, 256)
    two = DecodeConfig(block_n=16, num_warps=1, num_stages=1, partition_size=32, reduce_last=False)
    one = dataclasses.replace(two, reduce_last=True)
    want = paged_attention_decode(*args, out=torch.full_like(q, float("nan")), config=two)
    for _ in range(3):
        got = paged_attention_decode(*args, out=torch.full_like(q, float("nan")), config=one)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not decode_partitions._arrivals[q.device].any()  # every counter back at zero
    assert rel_err(got, paged_attention_decode_ref(*args)) < FP32_TOL


def test_choose_partitions() -> None:
    from llmfleet.kernels.paged_attention_decode import choose_partitions

    # batch 1, 8 KV heads, 132 SMs: 66 wanted, capped by 2048 / 128 = 16 of >= 128 tokens
    assert choose_partitions(1, 8, 2048, 64, 132, 128) == (16, 128)
    assert choose_partitions(1, 8, 2048, 64, 132, min_partition=64) == (32, 64)
    assert choose_partitions(64, 8, 4096, 64, 132, 128) == (1, 128)  # enough programs already
    assert choose_partitions(32, 8, 4096, 64, 132, 128) == (2, 128)  # 256 programs: split in 2
    assert choose_partitions(1, 8, 100, 64, 132, 128) == (1, 128)
    assert choose_partitions(2, 2, 1000, 48, 4, min_partition=100) == (4, 144)


@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_other_block_sizes_fp16(block_size: int) -> None:
    lens = [9, 33, 70]
    batch = PagedBatch(lens, 2, 64, block_size, torch.float16, DEVICE, seed=block_size)
    q = torch.randn(len(lens), 8, 64, device=DEVICE).half()
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1, partition_size=48)
    args = (q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125, batch.max_seq_len)
    out = paged_attention_decode(*args, config=cfg)
    assert rel_err(out, paged_attention_decode_ref(*args)) < 2e-3


class RopeStep:
    """A decode step as the attention layer gives it to `paged_attention_decode_rope`: rows
    (one new token each; `rows_of` tokens per sequence, consecutive, as a sequence's drafts
    are) over a random paged cache, q, k and v as views of one fused (rows, (H + 2 Hkv) D)
    qkv activation, rotary positions and table, and the rows' slots (`padding` rows: -1)."""

    def __init__(
        self,
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        rot_dim: int,
        dtype: torch.dtype,
        rows_of: list[int] | None = None,
        padding: tuple[int, ...] = (),
        head_dim: int = 64,
        seed: int = 0,
    ) -> None:
        rows_of = rows_of or [1] * len(seq_lens)
        self.batch = PagedBatch(seq_lens, num_kv_heads, head_dim, 16, dtype, DEVICE, seed=seed)
        lens, tables = [], []
        for n, r, table in zip(seq_lens, rows_of, self.batch.tables, strict=True):
            lens += range(n - r + 1, n + 1)  # row j of a sequence: context n - r + 1 + j
            tables += [table] * r
        bs = self.batch.block_size
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for n, t in zip(lens, tables, strict=True)]
        for i in padding:
            slots[i] = -1
        self.num_rows, self.dim = len(lens), head_dim
        self.heads, self.kv_heads = num_heads, num_kv_heads
        width = self.batch.block_tables.shape[1]
        self.block_tables = torch.tensor(
            [t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
        )
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        g = torch.Generator().manual_seed(seed + 1)
        qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
        self.qkv = qkv.to(device=DEVICE, dtype=dtype)
        self.positions = torch.randint(1, 256, (len(lens),), generator=g).to(DEVICE)
        self.cos_sin = build_cos_sin_cache(rot_dim, 256, 500000.0, device=DEVICE)

    def views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (self.num_rows, self.heads + 2 * self.kv_heads, self.dim)
        q, k, v = qkv.view(shape).split([self.heads, self.kv_heads, self.kv_heads], 1)
        return q, k, v

    def fused(self, fn=paged_attention_decode_rope, config: DecodeConfig | None = None, **kw):
        """(out, cache after, qkv after) of one fused call on copies of the inputs."""
        qkv, cache = self.qkv.clone(), self.batch.kv_cache.clone()
        q, k, v = self.views(qkv)
        if config is not None:
            kw["config"] = config
        out = fn(
            self.positions, q, k, v, self.cos_sin, cache, self.slot_mapping, self.block_tables,
            self.seq_lens, 0.125, int(self.seq_lens.max()), **kw,
        )  # fmt: skip
        return out, cache, qkv

    def two_kernels(self, config: DecodeConfig | None = None):
        """The same from `rotary_kv_cache_write` then `paged_attention_decode`."""
        qkv, cache = self.qkv.clone(), self.batch.kv_cache.clone()
        q, k, v = self.views(qkv)
        rotary_kv_cache_write(self.positions, q, k, v, self.cos_sin, cache, self.slot_mapping)
        out = paged_attention_decode(
            q, cache, self.block_tables, self.seq_lens, 0.125, int(self.seq_lens.max()),
            config=config,
        )  # fmt: skip
        return out, cache, qkv


# In the interpreter tl.dot multiplies bf16 operands as their raw 16-bit patterns (triton
# 3.9), so bf16 outputs are compared with the two kernels' bit for bit, not with a reference.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("partition_size", [None, 32])  # one partition; split, last reduces
@pytest.mark.parametrize("rot_dim", [64, 32])  # full and partial rotary
def test_decode_rope_equals_rotary_write_then_decode(
    dtype: torch.dtype, group: int, partition_size: int | None, rot_dim: int
) -> None:
    step = RopeStep([1, 15, 16, 17, 47, 80], 2 * group, 2, rot_dim, dtype, padding=(2,), seed=group)
    cfg = dataclasses.replace(SMALL_DECODE, partition_size=partition_size)
    out, cache, qkv = step.fused(config=cfg)
    want, want_cache, _ = step.two_kernels(config=cfg)
    assert torch.equal(out, want)
    assert torch.equal(cache, want_cache)
    assert torch.equal(qkv, step.qkv), "q, k and v are left as they were: unrotated"
    # Only the real rows' slots changed: each now holds its row's rotated k and its v.
    changed = (cache != step.batch.kv_cache).any(-1).any(-1).any(0).flatten()  # (slots,)
    real = step.slot_mapping[step.slot_mapping >= 0]
    assert changed.nonzero().flatten().tolist() == sorted(real.tolist())
    if dtype == torch.float32:
        ref, ref_cache, _ = step.fused(paged_attention_decode_rope_ref)
        assert rel_err(out, ref) < FP32_TOL and rel_err(cache, ref_cache) < 1e-6


@pytest.mark.parametrize("reduce_last", [True, False])
def test_decode_rope_drafts_as_rows(reduce_last: bool) -> None:
    """A sequence's token and its drafts as consecutive rows over one block table (context
    n - 2, n - 1, n: each row reads the rows before it), in 16-token partitions that split
    them; a padding row at the end, as in a padded CUDA graph."""
    step = RopeStep([33, 18, 1], 8, 2, 64, torch.float32, rows_of=[3, 2, 1], padding=(5,))
    cfg = DecodeConfig(16, 1, 1, partition_size=16, reduce_last=reduce_last)
    out, cache, _ = step.fused(config=cfg)
    want, want_cache, _ = step.two_kernels(config=cfg)
    assert torch.equal(out, want) and torch.equal(cache, want_cache)


def test_decode_rope_row_stores_the_rows_before_it() -> None:
    """Row 2's programs store the tokens of rows 0 and 1 (its sequence's, at the two positions
    before its own) as well as its own, since nothing orders the rows' programs on a GPU. The
    interpreter runs rows in order; here rows 0 and 1 are given no context, so that their own
    programs store nothing and the cache can only have been written by row 2's."""
    step = RopeStep([18], 4, 2, 64, torch.float32, rows_of=[3])  # tokens at 15, 16, 17
    step.seq_lens[:2] = 0
    for part in (None, 16):  # row 2's tokens in one partition; split over two
        cfg = dataclasses.replace(SMALL_DECODE, partition_size=part)
        out, cache, _ = step.fused(config=cfg)
        want, want_cache, _ = step.two_kernels(config=cfg)  # writes every row's token
        assert torch.equal(out[2], want[2]) and torch.equal(cache, want_cache)


def test_decode_rope_dispatch_and_arguments() -> None:
    step = RopeStep([5, 20], 4, 2, 64, torch.float32)
    forced, _, _ = step.fused(dispatch.paged_attention_decode_rope, force_triton=True)
    assert torch.equal(forced, step.fused()[0])
    if DEVICE == "cpu":  # without force_triton, CPU tensors take the reference
        ref, _, qkv = step.fused(dispatch.paged_attention_decode_rope)
        assert torch.equal(ref, step.fused(paged_attention_decode_rope_ref)[0])
        assert torch.equal(qkv, step.qkv)
    good = dict(zip(["positions", "q", "k", "v", "cos", "cache", "slots"], (
        step.positions, *step.views(step.qkv), step.cos_sin, step.batch.kv_cache,
        step.slot_mapping,
    ), strict=True))  # fmt: skip
    bad = {
        "positions": ("positions", step.positions[:1]),
        "k/v must be": ("v", step.views(step.qkv)[2][:, :1]),
        "cos_sin_cache": ("cos", torch.zeros(256, 66, device=DEVICE)),
        "slot_mapping": ("slots", step.slot_mapping.int()),
        "^k must have unit stride": ("k", step.views(step.qkv.clone())[1].transpose(1, 2)
                                     .contiguous().transpose(1, 2)),
    }  # fmt: skip
    for message, (name, value) in bad.items():
        args = {**good, name: value}
        for fn in (paged_attention_decode_rope, paged_attention_decode_rope_ref):
            if message.startswith("^") and fn is paged_attention_decode_rope_ref:
                continue  # the reference does not need unit strides
            with pytest.raises(ValueError, match=message):
                fn(*args.values(), step.block_tables, step.seq_lens, 0.125, 20)


# (query_len, seq_len) per sequence: full prefill, chunked continuation, prefix hit, decode rows.
PREFILL_CASES = {
    "full": [(20, 20), (1, 1), (33, 33)],
    "chunked": [(16, 48), (7, 40), (25, 26)],
    "mixed": [(1, 37), (18, 18), (1, 16), (40, 71)],
}


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_ref(group: int, case: str) -> None:
    num_kv_heads, head_dim = 2 if group < 4 else 1, 64
    shapes = PREFILL_CASES[case]
    batch = PagedBatch(
        [s for _, s in shapes], num_kv_heads, head_dim, 16, torch.float32, DEVICE, seed=group
    )
    starts = [0]
    for ql, _ in shapes:
        starts.append(starts[-1] + ql)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, device=DEVICE)
    max_q = max(ql for ql, _ in shapes)
    args = (q, batch.kv_cache, qsl, batch.seq_lens, batch.block_tables, 0.125, max_q)
    out = paged_attention_prefill(*args, out=torch.full_like(q, float("nan")), config=SMALL_PREFILL)
    assert rel_err(out, paged_attention_prefill_ref(*args)) < FP32_TOL


def test_prefill_ref_equals_plain_causal_attention() -> None:
    """The reference itself: one sequence with no prefix is ordinary causal attention."""
    batch = PagedBatch([24], 2, 64, 16, torch.float32, DEVICE)
    q = torch.randn(24, 4, 64, device=DEVICE)
    qsl = torch.tensor([0, 24], dtype=torch.int32, device=DEVICE)
    out = paged_attention_prefill_ref(
        q, batch.kv_cache, qsl, batch.seq_lens, batch.block_tables, 0.125, 24
    )
    table = batch.tables[0]
    k = batch.kv_cache[0, table].reshape(-1, 2, 64)[:24].repeat_interleave(2, dim=1)
    v = batch.kv_cache[1, table].reshape(-1, 2, 64)[:24].repeat_interleave(2, dim=1)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.125
    ).transpose(0, 1)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_kv_cache_write_matches_ref_with_padding_and_strided_inputs() -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 11, 2, 64, 16
    qkv = torch.randn(
        num_tokens, (4 + 2 * num_kv_heads) * head_dim, device=DEVICE
    )  # k, v are views of qkv
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(6 * block_size, device=DEVICE)[:num_tokens]
    slots[[3, 7]] = -1  # padding tokens
    cache = torch.randn(2, 6, block_size, num_kv_heads, head_dim, device=DEVICE)
    expect = cache.clone()
    kv_cache_write_ref(k, v, expect, slots)
    kv_cache_write(k, v, cache, slots)
    assert torch.equal(cache, expect)
    flat = expect[0].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0])


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_backend_writes_cache_then_attends(phase: str) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    if phase == "prefill":
        query_lens, seq_lens = [5, 30, 1], [5, 50, 20]
    else:
        query_lens, seq_lens = [1, 1, 1], [1, 17, 40]
    rng = random.Random(1)
    ids = list(range(12))
    rng.shuffle(ids)
    tables, used = [], 0
    for s in seq_lens:
        nb = -(-s // block_size)
        tables.append(ids[used : used + nb])
        used += nb
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    cache = torch.randn(2, 12, block_size, num_kv_heads, head_dim, device=DEVICE)
    n = meta.num_tokens
    q = torch.randn(n, num_heads, head_dim, device=DEVICE)
    k, v = torch.randn(n, 2, 64, device=DEVICE), torch.randn(n, 2, 64, device=DEVICE)
    ref_cache = cache.clone()
    ref_cache = ref_cache.cpu()
    ref_meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    ref = TritonAttentionBackend().forward(  # CPU tensors: the references
        q.cpu(), k.cpu(), v.cpu(), ref_cache, ref_meta, 0.125
    )
    out = TritonAttentionBackend(force_triton=True).forward(q, k, v, cache, meta, 0.125).cpu()
    assert torch.equal(cache.cpu(), ref_cache)
    assert rel_err(out, ref) < FP32_TOL


def test_dispatch_uses_reference_on_cpu_without_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(3, 4)
    assert not dispatch.use_triton(x)
    assert dispatch.use_triton(x, force_triton=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not dispatch.use_triton(x, force_triton=True)


# ----------------------------------------------------------------------------- GPU, real sizes


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(32, 8, 128), (32, 32, 64), (64, 8, 128)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_gpu(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    rng = random.Random(num_heads + block_size)
    lens = [rng.randint(1, 4096) for _ in range(48)] + [1, 4096, 4097, block_size]
    batch = PagedBatch(
        lens, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda", seed=rng.randint(0, 99)
    )
    q = torch.randn(len(lens), num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    args = (q, batch.kv_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5)
    ref = paged_attention_decode_ref(*args, batch.max_seq_len)
    for part in (None, 256, 8192):  # auto, many partitions, single partition
        cfg = DecodeConfig(partition_size=part)
        out = paged_attention_decode(*args, batch.max_seq_len, out=_poisoned(q), config=cfg)
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1e-2, part


@pytest.mark.gpu
def test_decode_rope_gpu() -> None:
    """Llama-3-8B shapes in bf16: 40 sequences of random length, every fourth with three
    drafts as rows after its token, two padding rows last; the fused kernel equals the two
    kernels bit for bit, launch after launch (drafts' rows read each other's stores)."""
    rng = random.Random(3)
    lens = [rng.randint(4, 3000) for _ in range(38)] + [4096, 4]
    rows_of = [4 if i % 4 == 0 else 1 for i in range(len(lens))]
    step = RopeStep(lens, 32, 8, 128, torch.bfloat16, rows_of, padding=(-2, -1), head_dim=128)
    ref, ref_cache, _ = step.fused(paged_attention_decode_rope_ref)
    for part in (None, 256, 8192):  # auto, many partitions, single partition
        cfg = DecodeConfig(partition_size=part)
        want, want_cache, _ = step.two_kernels(config=cfg)
        for _ in range(3):
            out, cache, qkv = step.fused(config=cfg)
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(cache, want_cache), part
        assert torch.equal(qkv, step.qkv)
        assert rel_err(out, ref) < 1e-2 and rel_err(cache, ref_cache) < 1e-2


GPU_PREFILL_CASES = {
    "long": [(1000, 1000), (512, 3000), (1, 777), (2048, 2048), (129, 130)],
    "short": [(100, 3000), (1, 50), (300, 300), (64, 1000), (1, 1)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_PREFILL_CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64)])
def test_prefill_gpu(case: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    shapes = GPU_PREFILL_CASES[case]
    batch = PagedBatch([s for _, s in shapes], num_kv_heads, head_dim, 16, torch.bfloat16, "cuda")
    starts = [0]
    for ql, _ in shapes:
        starts.append(starts[-1] + ql)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q = torch.randn(starts[-1], num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    max_q = max(ql for ql, _ in shapes)
    args = (q, batch.kv_cache, qsl, batch.seq_lens, batch.block_tables, head_dim**-0.5, max_q)
    ref = paged_attention_prefill_ref(*args)
    out = paged_attention_prefill(*args, out=_poisoned(q))
    torch.cuda.synchronize()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_kv_cache_write_gpu() -> None:
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 3000, 8, 128, 16, 1024
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::97] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda").bfloat16()
    expect = cache.clone()
    kv_cache_write_ref(k, v, expect, slots)
    kv_cache_write(k, v, cache, slots)
    assert torch.equal(cache, expect)
