"""One entry point per op: the Triton kernel where it can run, the PyTorch reference elsewhere.

Triton runs when the tensors are on a CUDA (or ROCm) device, or on the CPU when the caller
passes `force_triton=True` and TRITON_INTERPRET=1 is set (the interpreter tests). Every other
case (CPU serving, CPU tests of model code) takes the reference of the same function, so the
two paths agree on arguments and results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import llmfleet.kernels.argmax as _argmax
import llmfleet.kernels.gemv as _gemv
import llmfleet.kernels.int4_matmul as _i4
import llmfleet.kernels.int4_pack as _i4p
import llmfleet.kernels.kv_cache_write as _kvw
import llmfleet.kernels.paged_attention_decode as _decode
import llmfleet.kernels.paged_attention_prefill as _prefill
import llmfleet.kernels.quant as _quant
import llmfleet.kernels.rms_norm as _rms
import llmfleet.kernels.rotary as _rot
import llmfleet.kernels.rotary_kv_write as _rkv
import llmfleet.kernels.scaled_mm as _smm
import llmfleet.kernels.shard_embedding as _emb
import llmfleet.kernels.silu_and_mul as _silu
import llmfleet.kernels.skinny_gemm as _skinny
from llmfleet.kernels.triton_utils import interpreting

if TYPE_CHECKING:
    from llmfleet.kernels.all_reduce import PeerAllReduce


def use_triton(t: torch.Tensor, force_triton: bool = False) -> bool:
    """Whether the Triton path serves a call whose tensors live where `t` does."""
    if t.is_cuda:
        return True
    return force_triton and interpreting()


def kv_cache_write(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), in place
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), < 0 = skip
    force_triton: bool = False,
) -> None:
    fn = _kvw.kv_cache_write if use_triton(k, force_triton) else _kvw.kv_cache_write_ref
    fn(k, v, kv_cache, slot_mapping)


def paged_attention_decode(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens: torch.Tensor,  # int32 (num_seqs,)
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor:
    if use_triton(q, force_triton):
        fn = _decode.paged_attention_decode
    else:
        fn = _decode.paged_attention_decode_ref
    return fn(q, kv_cache, block_tables, seq_lens, scale, max_seq_len, out=out)


def paged_attention_decode_rope(
    positions: torch.Tensor,  # int (num_seqs,)
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim), unrotated; left as it is
    k: torch.Tensor,  # (num_seqs, num_kv_heads, head_dim), unrotated; left as it is
    v: torch.Tensor,  # (num_seqs, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), in place
    slot_mapping: torch.Tensor,  # int64 (num_seqs,), < 0 = skip the cache write
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens: torch.Tensor,  # int32 (num_seqs,)
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor:
    """`rotary_kv_cache_write` then `paged_attention_decode`, in one launch."""
    if use_triton(q, force_triton):
        fn = _decode.paged_attention_decode_rope
    else:
        fn = _decode.paged_attention_decode_rope_ref
    return fn(
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        scale,
        max_seq_len,
        out=out,
    )


def paged_attention_prefill(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 (num_seqs + 1,)
    seq_lens: torch.Tensor,  # int32 (num_seqs,)
    block_tables: torch.Tensor,  # int32 (num_seqs, max_blocks_per_seq)
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor:
    if use_triton(q, force_triton):
        fn = _prefill.paged_attention_prefill
    else:
        fn = _prefill.paged_attention_prefill_ref
    return fn(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len, out=out)


def rms_norm(
    x: torch.Tensor,  # (num_tokens, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: normed. With residual: (normed, x + residual)."""
    fn = _rms.rms_norm if use_triton(x, force_triton) else _rms.rms_norm_ref
    return fn(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,  # int (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), in place
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), in place
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    force_triton: bool = False,
) -> None:
    fn = _rot.rotary_embedding if use_triton(q, force_triton) else _rot.rotary_embedding_ref
    fn(positions, q, k, cos_sin_cache)


def rotary_kv_cache_write(
    positions: torch.Tensor,  # int (num_tokens,)
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), in place
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), in place
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), in place
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), < 0 = skip the cache write
    force_triton: bool = False,
) -> None:
    """`rotary_embedding` then `kv_cache_write` (of the rotated k), in one launch."""
    if use_triton(q, force_triton):
        fn = _rkv.rotary_kv_cache_write
    else:
        fn = _rkv.rotary_kv_cache_write_ref
    fn(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping)


def decode_linear(
    x: torch.Tensor,  # (M, K)
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,
    force_triton: bool = False,
    out: torch.Tensor | None = None,  # (M, N) of x's dtype or float32: written and returned
    push: PeerAllReduce | None = None,  # the group whose next all-reduce sums the result
) -> torch.Tensor:  # (M, N)
    """x @ weight.T (+ bias) at decode batch sizes, for 16-bit x and weight of one dtype (the
    weight unit-stride along K): one row runs the GEMV; 2..MAX_M rows run the skinny GEMM
    where this device's tuned file says it beat cuBLAS for the shape. Everything else (and
    everything off the GPU) runs `F.linear`. A float32 `out` receives the result's values
    (rounded to x's dtype, as `.float()` of it), without a separate conversion on our
    kernels' paths. `push`: the result is this rank's part of a sum that `push` takes next;
    where it is one row the GEMV computes, the GEMV also writes it into the peers' buffers
    (`PeerAllReduce.note_push`), so the sum only waits for theirs."""
    m, k = x.shape
    if _decode_kernels_serve(x, weight, force_triton):
        if m == 1:
            if push is not None and out is None and k > 0:
                out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
                if push.takes_push(out):
                    _gemv.gemv(x, weight, bias, out=out, push=push)
                    push.note_push(out)
                    return out
            return _gemv.gemv(x, weight, bias, out=out)
        cfg = _skinny.choose(m, weight.shape[0], k, x.dtype, x.device)
        if cfg is not None and x.stride(1) == 1:
            return _skinny.skinny_gemm(x, weight, bias, cfg, out=out)
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def decode_gated_linear(
    x: torch.Tensor,  # (M, K)
    weight: torch.Tensor,  # (2I, K): a fused [gate | up] projection
    bias: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor:  # (M, I)
    """silu(x @ gate.T) * (x @ up.T), the SwiGLU of a fused gate/up projection, at decode
    batch sizes: the gated GEMV (one row) or skinny GEMM (2..MAX_M rows) computes it in one
    kernel where this device's tuned file for the gated kernel has the shape; elsewhere
    `decode_linear` and then `silu_and_mul`."""
    m, k = x.shape
    if _decode_kernels_serve(x, weight, force_triton) and weight.shape[0] % 2 == 0:
        if m == 1:
            one = _gemv.gated_config(weight.shape[0], k, x.dtype, x.device)
            if one is not None:
                return _gemv.gemv(x, weight, bias, one, gated=True)
        else:
            cfg = _skinny.choose(m, weight.shape[0], k, x.dtype, x.device, gated=True)
            if cfg is not None and x.stride(1) == 1:
                return _skinny.skinny_gemm(x, weight, bias, cfg, gated=True)
    return silu_and_mul(decode_linear(x, weight, bias, force_triton), force_triton)


def _decode_kernels_serve(x: torch.Tensor, weight: torch.Tensor, force_triton: bool) -> bool:
    """Whether our decode-size linear kernels take this call (the rows' count aside)."""
    return (
        use_triton(x, force_triton)
        and 1 <= x.shape[0] <= _skinny.MAX_M
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    )


def silu_and_mul(x: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    """(num_tokens, 2I) -> silu(x[:, :I]) * x[:, I:]."""
    fn = _silu.silu_and_mul if use_triton(x, force_triton) else _silu.silu_and_mul_ref
    return fn(x)


def int4_matmul(
    x: torch.Tensor,  # (M, K) fp16/bf16 on GPUs; any float dtype for the reference
    qweight: torch.Tensor,  # (K // 8, N) int32
    scales: torch.Tensor,  # (K // G, N)
    zeros: torch.Tensor,  # (K // G, N)
    group_size: int,
    force_triton: bool = False,
) -> torch.Tensor:
    """(M, N) = x @ W, W = q * scales - zeros unpacked per group (kernels/int4_matmul.py)."""
    fn = _i4.int4_matmul if use_triton(x, force_triton) else _i4p.int4_matmul_ref
    return fn(x, qweight, scales, zeros, group_size)


def per_token_quant(
    x: torch.Tensor,  # (M, K) float, unit stride along K
    dtype: torch.dtype = _quant.FP8_DTYPE,
    force_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) `dtype`, scale (M, 1) float32), x ~= q * scale (kernels/quant.py)."""
    fn = _quant.per_token_quant if use_triton(x, force_triton) else _quant.per_token_quant_ref
    return fn(x, dtype)


def fp8_linear(
    x: torch.Tensor,  # (M, K) activations, unit stride along K
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (N,) float32, per output channel
    out_dtype: torch.dtype,
    force_triton: bool = False,
) -> torch.Tensor:
    """(M, N) = x @ (weight * weight_scale)^T with x quantized to FP8 per token first."""
    if use_triton(x, force_triton):
        q, scale = _quant.per_token_quant(x)
        return _smm.scaled_mm(q, weight, scale, weight_scale, out_dtype)
    q, scale = _quant.per_token_quant_ref(x)
    return _smm.scaled_mm_ref(q, weight, scale, weight_scale, out_dtype)


def argmax(x: torch.Tensor, force_triton: bool = False) -> torch.Tensor:  # (B, V) -> (B,)
    """`x.argmax(dim=-1)`: the two-pass Triton argmax for up to `MAX_ROWS` float32 rows
    (greedy sampling's rows over a vocabulary), torch's elsewhere."""
    if (
        use_triton(x, force_triton)
        and x.dim() == 2
        and x.dtype == torch.float32
        and 0 < x.shape[0] <= _argmax.MAX_ROWS
        and x.shape[1] > 0
        and x.stride(-1) == 1
    ):
        return _argmax.argmax(x)
    return x.argmax(dim=-1)


def shard_embedding(
    ids: torch.Tensor,  # int (T,)
    weight: torch.Tensor,  # (rows, hidden): this rank's vocabulary [start, start + rows)
    start: int,
    force_triton: bool = False,
) -> torch.Tensor:  # (T, hidden)
    """The embedding of the ids in this rank's rows, zeros for the others
    (kernels/shard_embedding.py)."""
    if use_triton(weight, force_triton):
        return _emb.shard_embedding(ids, weight, start)
    return _emb.shard_embedding_ref(ids, weight, start)
