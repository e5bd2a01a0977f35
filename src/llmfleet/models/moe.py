"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE).

Expert weights are stacked so that one fused-MoE kernel can replace `fused_moe_reference`:

    w13: (E, 2I, hidden)   rows [gate_e | up_e] of expert e
    w2:  (E, hidden, I)

Paths: CPU `fused_moe_reference`; CUDA half precision the Triton routing + fused MoE kernels
(kernels/fused_moe.py); CUDA float32 `fused_moe_dense`.

Tensor parallelism: every rank holds every expert, each expert's intermediate dimension split
like the dense MLP's (its rows of w13's gate and up halves, its columns of w2); the router is
replicated, so every rank routes alike, and the partial outputs are summed over the group.
"""

from __future__ import annotations

import torch
from torch import nn

from llmfleet.models.layers import silu_and_mul
from llmfleet.models.parallel import SINGLE, TensorParallel, split_evenly


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


def fused_moe_dense(
    x: torch.Tensor,  # (T, hidden)
    w13: torch.Tensor,  # (E, 2I, hidden)
    w2: torch.Tensor,  # (E, hidden, I)
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) integer
) -> torch.Tensor:  # (T, hidden)
    """The function of `fused_moe_reference` with every expert run over every token and its
    output weighted by the token's routing weight (zero when not chosen).

    No data-dependent shape and no host sync, so a CUDA graph can capture it, at E/k times the
    FLOPs: the path for float32 models on GPUs (verification runs), where the Triton kernel
    (half precision only) does not apply.
    """
    t, num_experts = x.shape[0], w13.shape[0]
    combine = torch.zeros((t, num_experts), dtype=x.dtype, device=x.device)  # (T, E)
    combine.scatter_(1, topk_ids.long(), topk_weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(num_experts):
        h = silu_and_mul(x @ w13[e].t())  # (T, I)
        out.addcmul_(h @ w2[e].t(), combine[:, e : e + 1])  # (T, hidden)
    return out


class SparseMoE(nn.Module):
    """Router + stacked experts. `renormalize` is True for Mixtral, `norm_topk_prob` for Qwen3.
    Under `tp` this rank holds each expert's intermediate features `intermediate_range`
    (`intermediate_size` of them)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp = tp
        self.full_intermediate_size = intermediate_size
        self.intermediate_range = split_evenly(intermediate_size, tp.size, tp.rank)
        self.intermediate_size = inter = len(self.intermediate_range)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        out = self._experts(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:  # this rank's partial sum
        # On CUDA both paths are free of host syncs, so decode steps can run in CUDA graphs.
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            from llmfleet.kernels.fused_moe import fused_moe  # Triton: only needed on GPUs
            from llmfleet.kernels.moe_routing import topk_routing

            weights, ids = topk_routing(self.gate(x), self.top_k, self.renormalize)
            return fused_moe(x, self.w13, self.w2, weights, ids)
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)  # (T, k) each
        if x.is_cuda:
            return fused_moe_dense(x, self.w13, self.w2, weights, ids)
        return fused_moe_reference(x, self.w13, self.w2, weights, ids)
