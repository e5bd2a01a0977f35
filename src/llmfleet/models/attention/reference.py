"""Plain-PyTorch paged attention: the CPU reference backend (also correct on GPU).

Two paths over the same cache layout (see `metadata.py`):

- pure decode (one query per sequence): gather every sequence's K/V through its block table
  into one padded (B, Hkv, max_len, D) tensor and run one masked SDPA, GQA folded into the
  query dimension (the G query heads of one KV head become G query rows), so no
  repeat_interleave;
- prefill / mixed batches: one SDPA call per sequence (GQA by broadcasting K/V). A sequence
  with no cached prefix attends over this step's own k/v with `is_causal`; otherwise its context
  is gathered from the cache and an explicit bottom-right-aligned causal mask is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.rotary import RotaryPositions


def write_kv_cache(
    k: torch.Tensor,  # (T, Hkv, D)
    v: torch.Tensor,  # (T, Hkv, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # int64 (T,)
) -> None:
    """Store this step's keys and values at their slots (in place)."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def dense_causal_attention(
    q: torch.Tensor,  # (Lq, H, D)
    k: torch.Tensor,  # (Lk, Hkv, D)
    v: torch.Tensor,  # (Lk, Hkv, D)
    scale: float,
) -> torch.Tensor:  # (Lq, H, D)
    """Causal attention of the last Lq positions of a sequence over its Lk keys (Lq <= Lk).

    Query i sits at position Lk - Lq + i and sees keys 0 .. Lk - Lq + i. Slot-free: useful as a
    test oracle and for a sequence whose whole context is at hand.
    """
    lq, h, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    g = h // hkv
    # GQA by broadcasting: query head h = kv * G + g reads KV head kv. An expanded (stride 0)
    # K/V keeps SDPA on its fused CPU kernel, much faster than repeat_interleave.
    qg = q.reshape(lq, hkv, g, d).permute(1, 2, 0, 3)  # (Hkv, G, Lq, D)
    kg = k.transpose(0, 1)[:, None].expand(hkv, g, lk, d)  # (Hkv, G, Lk, D)
    vg = v.transpose(0, 1)[:, None].expand(hkv, g, lk, d)
    if lq == lk:
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
    else:
        # SDPA's is_causal aligns top-left; with a cached prefix the diagonal is bottom-right.
        qpos = torch.arange(lk - lq, lk, device=q.device)  # (Lq,)
        kpos = torch.arange(lk, device=q.device)  # (Lk,)
        mask = kpos[None, :] <= qpos[:, None]  # (Lq, Lk)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(lq, h, d)  # (Lq, H, D)


class TorchReferenceBackend(AttentionBackend):
    """AttentionBackend in plain PyTorch; stateless, one instance may serve every layer."""

    name = "torch_reference"
    cuda_graph_safe = False  # sizes its gathers from the host-side lengths

    def write_cache(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, Hkv, D)
        slot_mapping: torch.Tensor,  # int64 (T,)
        rope: RotaryPositions | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rope is not None:
            q, k = rope.rotate_qk(q, k)
        write_kv_cache(k, v, kv_cache, slot_mapping)
        return q, k

    def decode(
        self,
        q: torch.Tensor,  # (B, H, D)
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (B, H, D)
        b, h, d = q.shape
        block_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
        g = h // hkv
        nb = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :nb].long()  # (B, nb)
        kv = kv_cache[:, tables]  # (2, B, nb, block_size, Hkv, D), one gather for K and V
        kv = kv.view(2, b, nb * block_size, hkv, d).permute(0, 1, 3, 2, 4)  # (2, B, Hkv, L, D)
        if b == 1:  # one sequence: its context is a prefix, no mask needed
            kv = kv[..., : meta.seq_lens_cpu[0], :]
            out = F.scaled_dot_product_attention(q.reshape(1, hkv, g, d), kv[0], kv[1], scale=scale)
            return out.reshape(b, h, d)
        pos = torch.arange(nb * block_size, device=q.device)  # (L,)
        valid = pos[None, :] < meta.seq_lens[:, None]  # (B, L)
        # SDPA with a boolean mask: faster on CPU than matmul + softmax.
        out = F.scaled_dot_product_attention(
            q.reshape(b, hkv, g, d),  # (B, Hkv, G, D): the G query heads of a KV head as rows
            kv[0],
            kv[1],
            attn_mask=valid[:, None, None, :],  # (B, 1, 1, L)
            scale=scale,
        )  # (B, Hkv, G, D)
        return out.reshape(b, h, d)

    def prefill(
        self,
        q: torch.Tensor,  # (T, H, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, H, D)
        if meta.num_tokens == 0:
            return q.new_empty(q.shape)
        block_size, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        out = torch.empty_like(q)
        start = 0
        for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + ql
            if ql == sl:
                # No cached prefix: the context is exactly this step's tokens.
                ctx_k, ctx_v = k[start:end], v[start:end]
            else:
                nb = -(-sl // block_size)
                blocks = meta.block_tables[i, :nb].long()  # (nb,)
                ctx = kv_cache[:, blocks].view(2, nb * block_size, hkv, d)[:, :sl]
                ctx_k, ctx_v = ctx[0], ctx[1]  # (sl, Hkv, D)
            out[start:end] = dense_causal_attention(q[start:end], ctx_k, ctx_v, scale)
            start = end
        return out
