"""The paged reference backend vs naive dense attention over the same sequences."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.attention.reference import (
    TorchReferenceBackend,
    dense_causal_attention,
)
from llmfleet.models.rotary import RotaryEmbedding


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Loop-over-everything oracle: q (Lq, H, D) at the last Lq of Lk positions."""
    lq, h, _ = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    out = torch.empty_like(q)
    for i in range(lq):
        visible = lk - lq + i + 1
        for head in range(h):
            kv = head // (h // hkv)
            s = (k[:visible, kv] @ q[i, head]) * scale  # (visible,)
            out[i, head] = torch.softmax(s, dim=0) @ v[:visible, kv]
    return out


def _run_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 8,
    block_size: int = 4,
    seed: int = 0,
) -> None:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    # The cached prefix of each sequence is already in its blocks.
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    for table, s, q_len, k, v in zip(tables, seq_lens, query_lens, full_k, full_v, strict=True):
        for pos in range(s - q_len):
            slot = table[pos // block_size] * block_size + pos % block_size
            flat[0, slot], flat[1, slot] = k[pos], v[pos]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g)
    new_k = torch.cat([k[s - n :] for k, s, n in zip(full_k, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([v[s - n :] for v, s, n in zip(full_v, seq_lens, query_lens, strict=True)])
    scale = 1 / math.sqrt(head_dim)

    out = TorchReferenceBackend().forward(q, new_k, new_v, cache, meta, scale)

    start = 0
    for i, n in enumerate(query_lens):
        ref = naive_attention(q[start : start + n], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    # This step's keys and values landed in their slots.
    for j, slot in enumerate(meta.slot_mapping.tolist()):
        assert torch.equal(flat[0, slot], new_k[j]) and torch.equal(flat[1, slot], new_v[j])


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_prefill_no_prefix(heads: tuple[int, int]) -> None:
    _run_case([5, 1, 9], [5, 1, 9], *heads)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_pure_decode(heads: tuple[int, int]) -> None:
    _run_case([1, 1, 1, 1], [1, 4, 5, 13], *heads)


def test_mixed_prefill_chunk_and_decode() -> None:
    # decode, chunk over a cached prefix ending mid-block, fresh prompt, chunk on a boundary
    _run_case([1, 3, 6, 4], [10, 7, 6, 12], 8, 2, seed=3)


def test_long_contexts_cross_many_blocks() -> None:
    _run_case([1, 1, 1], [61, 3, 40], 9, 3, head_dim=16, block_size=8, seed=5)
    _run_case([20, 1, 33], [61, 3, 40], 9, 3, head_dim=16, block_size=8, seed=6)


def test_dense_causal_attention_matches_naive() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 8, generator=g)
    k, v = torch.randn(2, 9, 2, 8, generator=g)
    torch.testing.assert_close(
        dense_causal_attention(q, k, v, 0.3), naive_attention(q, k, v, 0.3), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        dense_causal_attention(q, k[:5], v[:5], 0.3),
        naive_attention(q, k[:5], v[:5], 0.3),
        atol=1e-5,
        rtol=1e-5,
    )


def test_bfloat16_decode_close_to_float32() -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=g)
    meta = AttentionMetadata.build([1, 1], [7, 12], [[3, 1], [0, 5, 2]], 4)
    q = torch.randn(2, 4, 8, generator=g)
    k, v = torch.randn(2, 2, 2, 8, generator=g)
    backend = TorchReferenceBackend()
    ref = backend.forward(q, k, v, cache.clone(), meta, 0.35)
    out = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), meta, 0.35)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1], [7, 12]), ([3, 5], [3, 7])])
def test_rope_argument_rotates_q_and_k_first(query_lens: list[int], seq_lens: list[int]) -> None:
    """`rope=` gives what rotating q and k first, then calling without it, gives (partial
    rotary: 4 of 8 dimensions)."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 4, 2, 8, generator=g)
    meta = AttentionMetadata.build(query_lens, seq_lens, [[3, 1], [0, 5, 2]], 4)
    qkv = torch.randn(meta.num_tokens, 8, 8, generator=g)  # 4 q, 2 k, 2 v heads
    pos = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
    rope = RotaryEmbedding(4, 32, {"rope_type": "default", "rope_theta": 100.0}).at(
        torch.tensor(pos)
    )
    backend = TorchReferenceBackend()
    cache_a, cache_b = cache.clone(), cache.clone()
    q, k, v = qkv.clone().split([4, 2, 2], dim=1)
    out_a = backend.forward(q, k, v, cache_a, meta, 0.35, rope=rope)
    q, k, v = qkv.clone().split([4, 2, 2], dim=1)
    q, k = rope.rotate(torch.cat([q, k], dim=1), 4)
    out_b = backend.forward(q, k, v, cache_b, meta, 0.35)
    assert torch.equal(out_a, out_b) and torch.equal(cache_a, cache_b)
    assert not torch.equal(cache_a, cache)  # something was written (rotated k)
