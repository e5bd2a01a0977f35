"""The INT4 weight layout of kernels/int4_matmul.py: packing, GGUF Q4_0/Q4_1 conversion and the
PyTorch reference product. Plain PyTorch/NumPy (no Triton), so CPU-only installs can use it.

For W of logical shape (K, N) = (in_features, out_features):

    qweight (K // 8, N) int32   bits [4j, 4j + 4) of qweight[i, n] hold q[8 i + j, n], j = 0..7
                                 (nibble 0 = lowest 4 bits = the smallest k), q in 0..15
    scales  (K // G, N)          one per group of G consecutive k and column n
    zeros   (K // G, N)          the zero point already multiplied by the scale

    W[k, n] = q[k, n] * scales[k // G, n] - zeros[k // G, n]

Storing the scaled zero point keeps every format exact: GPTQ/AWQ integer zero point z gives
zeros = z * s; GGUF Q4_0 (w = d (q - 8)) gives zeros = 8 d; Q4_1 (w = d q + m) gives zeros = -m,
also when d == 0. The group size G is 32, 64 or 128 (GGUF blocks are 32).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_SIZES = (32, 64, 128)
GGUF_BLOCK = 32  # weights per Q4_0/Q4_1 block
_Q4_0_BYTES = 18  # fp16 d, 16 bytes of nibbles
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


# ---- packing: (K, N) nibbles <-> (K // 8, N) int32, and GGUF Q4_0 / Q4_1 blocks ----


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack q (K, N) integers in 0..15 into (K // 8, N) int32: q[8 i + j, n] -> bits 4j..4j+3."""
    if q.dim() != 2 or q.shape[0] % 8 != 0:
        raise ValueError(f"q must be (K, N) with K a multiple of 8, got {tuple(q.shape)}")
    k, n = q.shape
    nib = q.to(torch.int64).reshape(k // 8, 8, n) & 0xF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device).view(1, 8, 1)
    words = (nib << shifts).sum(dim=1)  # (K // 8, N), 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (K // 8, N) int32 -> (K, N) uint8 in 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, 8, 1)
    nib = (qweight.unsqueeze(1) >> shifts) & 0xF  # arithmetic shift; the mask drops sign bits
    return nib.reshape(qweight.shape[0] * 8, qweight.shape[1]).to(torch.uint8)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """W (K, N) float32 = q * scales - zeros, groups of `group_size` rows."""
    q = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = zeros.float().repeat_interleave(group_size, dim=0)
    return q * s - z


def _gguf_blocks(blocks: np.ndarray | torch.Tensor, block_bytes: int) -> torch.Tensor:
    # A copy: GGUF tensors are read-only views of the file's memory map.
    t = torch.from_numpy(np.array(blocks)) if isinstance(blocks, np.ndarray) else blocks
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] % block_bytes != 0:
        raise ValueError(f"GGUF blocks must be uint8 (N, nblocks * {block_bytes}), got {t.shape}")
    return t.contiguous().view(t.shape[0], t.shape[1] // block_bytes, block_bytes)


def _gguf_nibbles(qs: torch.Tensor) -> torch.Tensor:
    # A block's 16 bytes hold weight j in the low nibble and weight j + 16 in the high one.
    n, nb, _ = qs.shape
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # (N, nb, 32)
    return q.reshape(n, nb * GGUF_BLOCK).t()  # (K, N)


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)  # little-endian fp16 -> (N, nb)


def pack_gguf_q4_0(
    blocks: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 tensor (N rows, nblocks * 18 bytes) -> (qweight, scales, zeros), group 32.

    Each block: fp16 d, then 16 bytes of nibbles; w = d * (q - 8). Returns tensors on the CPU.
    """
    b = _gguf_blocks(blocks, _Q4_0_BYTES)
    d = _half(b[..., 0:2]).t().float()  # (K // 32, N)
    qweight = pack_int4(_gguf_nibbles(b[..., 2:]))
    return qweight, d.to(dtype).contiguous(), (8.0 * d).to(dtype).contiguous()


def pack_gguf_q4_1(
    blocks: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 tensor (N rows, nblocks * 20 bytes) -> (qweight, scales, zeros), group 32.

    Each block: fp16 d, fp16 m, then 16 bytes of nibbles; w = d * q + m. Returns CPU tensors.
    """
    b = _gguf_blocks(blocks, _Q4_1_BYTES)
    d = _half(b[..., 0:2]).t().float()
    mn = _half(b[..., 2:4]).t().float()
    qweight = pack_int4(_gguf_nibbles(b[..., 4:]))
    return qweight, d.to(dtype).contiguous(), (-mn).to(dtype).contiguous()


def int4_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """PyTorch reference of `int4_matmul` (float32 dequantization and product)."""
    w = dequantize_int4(qweight, scales, zeros, group_size)
    return (x.float() @ w).to(x.dtype)


def random_int4(
    k: int, n: int, group: int, dtype: torch.dtype, device: str | torch.device = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed INT4 weights for a (k, n) matmul with `group`-row groups, as the kernels
    take them: (packed q, scales, zeros); for tests and benchmarks."""
    q = torch.randint(0, 16, (k, n), device=device, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, device=device) * 0.02 + 0.002).to(dtype)
    zeros = (torch.randint(0, 16, (k // group, n), device=device).float() * scales.float()).to(
        dtype
    )
    return pack_int4(q), scales, zeros
