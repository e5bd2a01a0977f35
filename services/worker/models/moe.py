"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE).

Expert weights are stacked so that one fused-MoE kernel can replace `fused_moe_reference`:

    w13: (E, 2I, hidden)   rows [gate_e | up_e] of expert e
    w2:  (E, hidden, I)
"""

from __future__ import annotations

import torch
from torch import nn

from llmfleet.services.worker.models.layers import silu_and_mul


def route_topk(
    router_logits: torch.Tensor,  # (T, E)
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (float32), keep the top k, optionally renormalize them to sum 1.

    Returns weights (T, k) float32 and expert ids (T, k) int64.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_reference(
    x: torch.Tensor,  # (T, hidden)
    w13: torch.Tensor,  # (E, 2I, hidden)
    w2: torch.Tensor,  # (E, hidden, I)
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64
) -> torch.Tensor:  # (T, hidden)
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), tokens grouped per expert.

    The (token, choice) pairs are sorted by expert so each expert runs one matmul over a
    contiguous gather of its tokens; the loop is over experts, never over tokens.
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # (T*k,)
    order = torch.argsort(flat_ids, stable=True)  # (T*k,)
    token_of = order // k  # (T*k,) source token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    weights_sorted = topk_weights.reshape(-1)[order].to(x.dtype)  # (T*k,)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = token_of[start : start + n]  # (n,)
        h = silu_and_mul(x[idx] @ w13[e].t())  # (n, I)
        y = (h @ w2[e].t()) * weights_sorted[start : start + n, None]  # (n, hidden)
        out.index_add_(0, idx, y)
        start += n
    return out


class SparseMoE(nn.Module):
    """Router + stacked experts. `renormalize` is True for Mixtral, `norm_topk_prob` for Qwen3."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)  # (T, k) each
        return fused_moe_reference(x, self.w13, self.w2, weights, ids)
