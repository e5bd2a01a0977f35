"""The sync-free MoE path (float32 on GPUs, CUDA graphs) computes the reference's function."""

from __future__ import annotations

import torch

from llmfleet.models.moe import fused_moe_dense, fused_moe_reference, route_topk


def test_dense_moe_equals_sorted_reference():
    g = torch.Generator().manual_seed(0)
    t, hidden, inter, experts, k = 9, 32, 24, 6, 2
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(t, experts, generator=g)
    logits[:, 5] = -1e4  # expert 5 is chosen by no token
    weights, ids = route_topk(logits, k, renormalize=True)
    assert not (ids == 5).any()
    want = fused_moe_reference(x, w13, w2, weights, ids)
    got = fused_moe_dense(x, w13, w2, weights, ids.to(torch.int32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
