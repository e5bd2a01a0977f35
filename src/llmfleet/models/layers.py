"""Building blocks shared by every architecture: norm, activation, dense MLP, attention, and
the pre-norm decoder layer made of them.

Projections that are applied to the same input are fused into one weight (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`); the HF checkpoint tensors are copied into row slices
of the fused weight by `load_shard`. Activations are flattened token-major: (T, hidden).

Tensor parallelism (parallel.py): given a `tp` of size > 1, attention keeps this rank's query
and KV heads and the MLP its slice of the intermediate size (column-parallel qkv / gate_up);
o_proj and down_proj are `RowParallelLinear` (partial sums, all-reduced, bias added once).
A decoder layer leaves a bias-free row-parallel sum to the RMSNorm that follows it
(`summed_norm`): where the ranks are GPUs of one host, summing, the residual add and the norm
are one kernel (kernels/all_reduce.py). At size 1 the modules are exactly the unsplit ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.parallel import SINGLE, TensorParallel, kv_head_partition, split_evenly
from llmfleet.models.rotary import RotaryPositions


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 as HF does.

    With `residual` given, the sum x + residual is normalized and returned too, so a decoder
    layer passes (out, residual) along instead of materializing the add separately.
    """

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused native op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # the fused Triton kernel (add + norm in one pass)
            from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

            shape = x.shape
            x2 = x.reshape(-1, shape[-1])  # (tokens[*heads], size): q/k norms are per head
            res2 = None if residual is None else residual.reshape(-1, shape[-1])
            out = dispatch.rms_norm(x2, self.weight, self.eps, res2)
            if residual is None:
                return out.view(shape)  # type: ignore[union-attr]
            normed, new_res = out  # type: ignore[misc]
            return normed.view(shape), new_res.view(shape)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2I) laid out [gate | up] -> (..., I) = silu(gate) * up."""
    if x.is_cuda and x.dim() == 2:
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        return dispatch.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    push: TensorParallel | None = None,
) -> torch.Tensor:
    """`F.linear`, except up to 64 16-bit rows on CUDA (decode steps): one row runs the Triton
    GEMV (kernels/gemv.py), which streams the weight faster than cuBLAS at M = 1 on every
    Llama-3-8B projection shape; 2..64 rows run the skinny GEMM (kernels/skinny_gemm.py) on
    the shapes where this GPU's tuned file says it beat cuBLAS (docs/benchmarks.md). `out`
    (the result's shape, x's dtype or float32) receives the result, which is then returned.
    `push`: the result is this rank's part of a sum over that group, taken next (by
    `tp.all_reduce` or `summed_norm`); a one-row GEMV then sends it to the peers itself."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= 64:
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        peer = push.peer if push is not None else None
        return dispatch.decode_linear(x, weight, bias, out=out, push=peer)
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def gated_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # (T, 2I) weight [gate | up] -> (T, I)
    """`silu_and_mul(linear(x, weight, bias))` for a fused [gate | up] weight. Up to 64
    16-bit rows on CUDA compute the activation in the projection's kernel where ours serves
    the shape (`dispatch.decode_gated_linear`), saving the activation's launch and its
    round trip through memory."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= 64:
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        return dispatch.decode_gated_linear(x, weight, bias)
    return silu_and_mul(linear(x, weight, bias))


class Linear(nn.Linear):
    """nn.Linear through `linear`: the same parameters, state dict and results."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A linear layer whose input features are split across the ranks of `tp`: each rank
    multiplies its columns of the weight, the partial outputs are summed over the group, then
    the (full, replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, push=self.tp))
        return y if self.bias is None else y + self.bias


def unsummed(proj: nn.Module) -> TensorParallel | None:
    """The group over which a row-parallel projection `proj` may leave its sum to the norm
    after it (`summed_norm`, called with `reduce=False` on the module holding it): a plain
    `RowParallelLinear` without bias. None for every other layer, which sums (and adds its
    bias) itself."""
    if type(proj) is RowParallelLinear and proj.bias is None:
        return proj.tp
    return None


def summed_norm(
    norm: RMSNorm,
    x: torch.Tensor,  # (T, hidden): this rank's part of the sum, or all of it (tp None)
    residual: torch.Tensor | None,  # (T, hidden), or None: the sum starts the residual stream
    tp: TensorParallel | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm(x summed over tp, residual)`: one kernel where the group's peer all-reduce takes
    x (its GPUs write their rows into each other's memory, then add and normalize), else the
    group's all-reduce and then the norm. Returns (normed, new residual) as RMSNorm does."""
    if tp is not None and tp.peer is not None and tp.peer.fits(x):
        return tp.peer(x, norm.weight, norm.eps, residual)
    if tp is not None:
        x = tp.all_reduce(x)
    if residual is None:
        return norm(x), x  # type: ignore[return-value]
    return norm(x, residual)  # type: ignore[return-value]


def row_parallel_group(linear: nn.Module) -> TensorParallel | None:
    """The group a layer replacing `linear` sums its partial outputs over (`rowwise_linear`'s
    `tp`): a `RowParallelLinear`'s, else None."""
    return linear.tp if isinstance(linear, RowParallelLinear) else None


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> Linear:
    """`Linear` at size 1, else the `RowParallelLinear` of this rank's `in_features`."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows `vocab` of the embedding table: ids outside them embed to zeros and
    the sum over the group gives every rank the full embedding."""

    def __init__(self, vocab: range, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T,) -> (T, H)
        """`reduce=False`: this rank's part, to be summed over `tp` (`summed_norm`)."""
        from llmfleet.kernels import dispatch  # (the reference off the GPU)

        out = dispatch.shard_embedding(ids, self.weight, self.vocab.start)
        return self.tp.all_reduce(out) if reduce else out


def rowwise_linear(
    x: torch.Tensor,  # (..., in_features)
    out_features: int,
    bias: torch.Tensor | None,
    matmul: Callable[[torch.Tensor], torch.Tensor],  # (rows, in) unit-stride -> (rows, out)
    tp: TensorParallel | None = None,
) -> torch.Tensor:  # (..., out_features)
    """A quantized linear layer's forward around its `matmul`: flatten the leading dims, make
    the last one unit-stride (what the kernels require), add the bias, restore the shape.
    With `tp` (a row-parallel rank's input columns) the partial outputs are summed over the
    group before the bias is added, once, as in `RowParallelLinear`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = matmul(x2)
    if tp is not None:
        out = tp.all_reduce(out)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out_features)


def load_shard(param: torch.Tensor, weight: torch.Tensor, offset: int = 0) -> None:
    """Copy `weight` into rows offset .. offset + len(weight) of `param` (a fused weight)."""
    rows = weight.shape[0]
    if offset + rows > param.shape[0] or tuple(weight.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"shard of shape {tuple(weight.shape)} at row {offset} "
            f"does not fit {tuple(param.shape)}"
        )
    with torch.no_grad():
        param[offset : offset + rows].copy_(weight)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Under `tp` this rank holds the
    intermediate features `intermediate_range` (`intermediate_size` of them)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.full_intermediate_size = intermediate_size
        self.intermediate_range = split_evenly(intermediate_size, tp.size, tp.rank)
        self.intermediate_size = inter = len(self.intermediate_range)
        self.gate_up_proj = Linear(hidden_size, 2 * inter, bias=bias)
        self.down_proj = row_linear(inter, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, hidden)
        """`reduce=False` (where `unsummed(down_proj)`): this rank's part of the output."""
        gate_up = self.gate_up_proj
        if type(gate_up) is Linear:  # not replaced by a quantized layer
            y = gated_linear(x, gate_up.weight, gate_up.bias)
        else:
            y = silu_and_mul(gate_up(x))  # via (T, 2I) -> (T, I)
        if reduce:
            return self.down_proj(y)
        return linear(y, self.down_proj.weight, push=unsummed(self.down_proj))

    def shard_offset(self, hf_proj: str) -> int:
        """Row offset in gate_up_proj of the HF projection `gate_proj` or `up_proj`."""
        return 0 if hf_proj == "gate_proj" else self.intermediate_size


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional per-head q/k RMSNorm
    (Qwen3), rotary, the paged attention backend, output projection.

    Under `tp` this rank holds the query heads `q_heads` and KV heads `kv_heads` of
    `kv_head_partition` (global indices); `num_heads` / `num_kv_heads` count its own."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.kv_heads, self.q_heads = kv_head_partition(num_kv_heads, num_heads, tp.size)[tp.rank]
        self.num_heads, self.num_kv_heads = len(self.q_heads), len(self.kv_heads)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = row_linear(self.q_size, hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def shard_offset(self, hf_proj: str) -> int:
        """Row offset in qkv_proj of the HF projection `q_proj`, `k_proj` or `v_proj`."""
        return {"q_proj": 0, "k_proj": self.q_size, "v_proj": self.q_size + self.kv_size}[hf_proj]

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rope: RotaryPositions,
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hkv, D)
        meta: AttentionMetadata,
        reduce: bool = True,  # False (where `unsummed(o_proj)`): this rank's part of the output
    ) -> torch.Tensor:  # (T, hidden)
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        qkv = qkv.view(t, h + 2 * hkv, self.head_dim)
        q, k, v = qkv.split([h, hkv, hkv], dim=1)  # views: (T, H, D), (T, Hkv, D), (T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The backend rotates q and k: on GPUs fused with its KV cache write (in place), or at a
        # pure decode step with the attention itself (in registers, q and k left unrotated).
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, rope=rope)  # (T, H, D)
        o = o.reshape(t, self.q_size)
        return (
            self.o_proj(o) if reduce else linear(o, self.o_proj.weight, push=unsummed(self.o_proj))
        )


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(
        self,
        h: torch.Tensor,  # (T, hidden)
        residual: torch.Tensor | None,  # (T, hidden) or None before the first layer
        rope: RotaryPositions,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        pending: TensorParallel | None = None,
        defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`pending`: h is this rank's part of the previous layer's output (or of the
        embedding, before the first layer), to be summed over that group with the input norm.
        `defer` (where `deferrable`): the MLP's output comes back unsummed likewise. A
        row-parallel o_proj's sum is always taken with the norm."""
        if residual is None and pending is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = summed_norm(self.input_layernorm, h, residual, pending)
        attn_tp = unsummed(self.self_attn.o_proj)
        h = self.self_attn(h, rope, kv_cache, meta, reduce=attn_tp is None)
        h, residual = summed_norm(self.post_attention_layernorm, h, residual, attn_tp)
        return (self.mlp(h, reduce=False) if defer else self.mlp(h)), residual

    def deferrable(self) -> TensorParallel | None:
        """The group this layer's MLP output may be left unsummed over (`defer`), or None."""
        return unsummed(self.mlp.down_proj) if type(self.mlp) is MLP else None
