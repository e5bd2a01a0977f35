"""Fused MoE: grouped GEMM over token slots sorted by expert (see moe_routing for the sort).

    x (T, H) --gate-up--> inter (T*k, I) = silu(x w1_gate^T) * (x w1_up^T)   [one kernel]
             --down-----> y (T*k, H) = routing_weight * inter w2^T           [one kernel]
             --sum over k--> out (T, H)           [in the down kernel up to 128 slots]

Layouts (all unit-stride along their last dimension):
    x        (T, H)        float16/bfloat16 hidden states
    w1       (E, 2I, H)    rows [0, I) are the gate projection, rows [I, 2I) the up projection
    w2       (E, H, I)     down projection
    topk_weights (T, k) float32, topk_ids (T, k) int32 (from topk_routing)
    FP8 (W8A8): w1/w2 float8_e4m3fn with scales (E,) per expert-tensor or (E, rows) per output
    channel (rows = 2I for w1, H for w2); activations are quantized per token on the fly.

Each program owns a BLOCK_M x BLOCK_N output tile of one block of `sorted_token_ids`, hence of a
single expert; it gathers its A rows by slot (x row = slot // k) and streams that expert's
weight rows. SiLU-and-mul is fused into the gate-up epilogue: the program keeps two accumulators
(gate rows n and up rows I + n), so the (T*k, 2I) pre-activation never reaches memory.

Block configurations come from JSON files in configs/fused_moe/ named
`E={E},N={I},device_name={name},dtype={bf16|fp8_w8a8}.json`, mapping a token count M to a
config; the entry tuned at the M nearest by ratio is used, if it lies within 4x (`pick_config`).
Farther from every entry, or without a file, `default_config` chooses by the mean rows per
expert. `tune_fused_moe.py` writes the files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmfleet.kernels.moe_routing import moe_align_block_size
from llmfleet.kernels.quant import per_token_quant
from llmfleet.kernels.triton_utils import ZeroedWorkspace, sm90_or_later

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs" / "fused_moe"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
FP8_DTYPE = torch.float8_e4m3fn
# Up to this many token slots (T * top_k: decode sizes) the down GEMM's last program per column
# tile also sums the top-k rows, saving a launch; beyond it a separate sum is cheaper than one
# program per column tile reading every row.
FUSED_SUM_MAX_SLOTS = 128
_COUNTERS = ZeroedWorkspace("fused_moe top-k sum")


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    b_desc,  # with B_TMA: a tensor descriptor over B as (E * rows, K), tiles (BLOCK_N, BLOCK_K)
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,  # unused with SLOT_BLOCKS
    expert_ids_ptr,  # the block's expert; with SLOT_BLOCKS the flat topk_ids (one per slot)
    num_post_padded_ptr,  # unused with SLOT_BLOCKS
    out_ptr,  # (T, H) when SUM_TOPK: out[t] = sum over j of C[t * top_k + j]
    cnt_ptr,  # int32 arrival counters, one per column tile, zero between calls
    top_k,
    N,  # output columns (I for gate-up, H for down)
    K,
    num_slots,  # T * k; sorted ids >= num_slots are padding
    max_padded,
    stride_am,  # elements between rows of A (T, H) or (T*k, I); unit-stride along K
    stride_be,  # elements between experts of B (E, rows, K)
    b_rows,  # rows of B per expert (2I for gate-up, H for down)
    stride_bn,  # elements between rows of B; unit-stride along K
    stride_cm,  # elements between rows of C (T*k, N); unit-stride along N
    stride_bse,  # elements between experts of b_scale (E,) or (E, rows)
    A_ROW_DIV: tl.constexpr,  # slot -> A row: k for x (T, H), 1 for inter (T*k, I)
    GATED: tl.constexpr,  # gate-up: C = silu(A Bg^T) * (A Bu^T), Bu rows offset by N
    MUL_WEIGHT: tl.constexpr,  # down: C *= topk_weights[slot]
    SLOT_BLOCKS: tl.constexpr,  # block b holds slot b alone (no sorted ids: one token)
    SUM_TOPK: tl.constexpr,  # down: the last program of each column tile sums C's k rows
    FP8: tl.constexpr,  # A, B float8: per-row a_scale, b_scale per expert or channel
    B_SCALE_PER_CHANNEL: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # float32 dot: the CPU interpreter mis-multiplies bfloat16
    B_TMA: tl.constexpr,  # B tiles through the descriptor (TMA) instead of pointer loads
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = max_padded // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows
    if SLOT_BLOCKS:
        num_post_padded = max_padded  # num_slots blocks, all in use
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots)
    else:
        num_post_padded = tl.load(num_post_padded_ptr)
        if pid_m * BLOCK_M >= num_post_padded:
            return
        slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    slot_mask = slots < num_slots
    a_rows = tl.where(slot_mask, slots // A_ROW_DIV, 0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    bg_ptrs = b_base + cols[None, :] * stride_bn + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
    bu_ptrs = bg_ptrs + N * stride_bn
    # With B_TMA a tile that runs past this expert's rows reads the next expert's (past the
    # last one, zeros): those columns are >= N and never stored.
    b_row = (expert * b_rows + pid_n * BLOCK_N).to(tl.int32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        if B_TMA:  # columns past K come back as zeros
            bg = b_desc.load([b_row, k0]).T
        else:
            bg = tl.load(bg_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g)
        if GATED:
            if B_TMA:
                bu = b_desc.load([b_row + N, k0]).T
            else:
                bu = tl.load(bu_ptrs, mask=k_mask[:, None], other=0.0)
            if UPCAST_DOT:
                bu = bu.to(tl.float32)
            acc_u = tl.dot(a, bu, acc_u)
            bu_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        bg_ptrs += BLOCK_K

    if FP8:
        a_s = tl.load(a_scale_ptr + a_rows, mask=slot_mask, other=0.0)[:, None]
        if B_SCALE_PER_CHANNEL:
            acc_g = acc_g * a_s * tl.load(b_scale_ptr + expert * stride_bse + cols)[None, :]
            if GATED:
                bs_u = tl.load(b_scale_ptr + expert * stride_bse + N + cols)[None, :]
                acc_u = acc_u * a_s * bs_u
        else:
            b_s = tl.load(b_scale_ptr + expert)
            acc_g = acc_g * (a_s * b_s)
            acc_u = acc_u * (a_s * b_s)
    if GATED:
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        out = acc_g
    if MUL_WEIGHT:
        out = out * tl.load(topk_weights_ptr + slots, mask=slot_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(
        c_ptrs, out.to(c_ptr.dtype.element_ty), mask=slot_mask[:, None] & (offs_n < N)[None, :]
    )
    if SUM_TOPK:
        _sum_topk_last(c_ptr, out_ptr, cnt_ptr + pid_n, num_post_padded // BLOCK_M, num_slots,
                       top_k, offs_n, N, stride_cm, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _sum_topk_last(
    c_ptr, out_ptr, counter, arrivals, num_slots, top_k, offs_n, N, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """After this program's C tile is stored: count it in for its column tile, and if it is the
    last of the `arrivals` programs there, write out[t] = sum over j of C[t * top_k + j] for
    every token t (slot order, float32: deterministic) and re-arm the counter. Saves the
    separate top-k sum launch at decode sizes."""
    tl.debug_barrier()  # every thread's C stores precede the release below
    if tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1:
        tl.debug_barrier()
        n_ok = offs_n < N
        for t0 in range(0, num_slots // top_k, BLOCK_M):
            offs_t = t0 + tl.arange(0, BLOCK_M)
            mask = (offs_t < num_slots // top_k)[:, None] & n_ok[None, :]
            rows = offs_t[:, None].to(tl.int64) * top_k
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in range(top_k):
                part = tl.load(
                    c_ptr + (rows + j) * stride_cm + offs_n[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg",  # written by other SMs: read at L2
                )  # fmt: skip
                acc += part.to(tl.float32)
            o_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(counter, 0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def config_file_name(num_experts: int, inter_size: int, device_name: str, dtype: str) -> str:
    device = device_name.replace(" ", "_")
    return f"E={num_experts},N={inter_size},device_name={device},dtype={dtype}.json"


@functools.lru_cache(maxsize=64)
def load_configs(
    num_experts: int, inter_size: int, device_name: str, dtype: str
) -> dict[int, dict[str, int]] | None:
    """Tuned configs {M: config} for this shape and device, or None when no file exists."""
    path = CONFIG_DIR / config_file_name(num_experts, inter_size, device_name, dtype)
    if not path.is_file():
        return None
    with path.open() as f:
        raw = json.load(f)
    logger.info("fused_moe: using tuned configs %s", path.name)
    return {int(m): cfg for m, cfg in raw.items()}


def merge_config_tables(
    old: dict[str, dict[str, int]], new: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`old`'s entries with `new`'s added or replacing them, ordered by M as `load_configs`
    reads them (a key that is not a token count raises ValueError, naming it)."""
    merged = {**old, **new}
    return {m: merged[m] for m in sorted(merged, key=int)}


def default_config(num_tokens: int, num_experts: int, top_k: int) -> dict[str, int]:
    """Untuned choice by mean rows per expert (T * k / E). Few rows: the GEMM streams weights,
    so small BLOCK_M (little padding) and long BLOCK_K; many rows: tensor-core tiles."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)
        return {**cfg, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        cfg = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)
        return {**cfg, "num_warps": 4, "num_stages": 4}
    if rows <= 256:
        cfg = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8)
        return {**cfg, "num_warps": 4, "num_stages": 4}
    cfg = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8)
    return {**cfg, "num_warps": 8, "num_stages": 3}


# A tuned entry serves token counts up to this factor away from the M it was tuned at. Tables
# tuned at 1, 16, 64, 512, 4096 cover every M up to 16384; a sparse one does not stretch a
# decode tile over prefill sizes, where such a tile is far slower.
ENTRY_REACH = 4


def pick_config(
    table: dict[int, dict[str, int]] | None, num_tokens: int, num_experts: int, top_k: int
) -> dict[str, int]:
    """The table's entry tuned at the M nearest `num_tokens` by ratio, if within ENTRY_REACH
    of it; otherwise (or without a table) `default_config`."""
    t = max(num_tokens, 1)
    if table:
        m = min(table, key=lambda key: (abs(math.log(max(key, 1) / t)), key))
        if max(m, t) <= ENTRY_REACH * max(min(m, t), 1):
            return table[m]
    return default_config(num_tokens, num_experts, top_k)


def get_config(
    num_tokens: int, num_experts: int, inter_size: int, top_k: int, dtype: str, device: torch.device
) -> dict[str, int]:
    """The block configuration for `num_tokens` tokens: this device's tuned file through
    `pick_config`, or `default_config`."""
    table = None
    if device.type == "cuda":
        table = load_configs(num_experts, inter_size, torch.cuda.get_device_name(device), dtype)
    return pick_config(table, num_tokens, num_experts, top_k)


def _check_scale(s: torch.Tensor | None, num_experts: int, rows: int, name: str) -> bool:
    if s is None or s.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor for FP8 weights")
    if s.shape == (num_experts,):
        return False
    if s.shape == (num_experts, rows) and s.stride(1) == 1:
        return True
    raise ValueError(f"{name} must be ({num_experts},) or ({num_experts}, {rows}), got {s.shape}")


_weight_tma: bool | None = None  # None: `_weight_descriptor` decides; see `weight_tma`


@contextlib.contextmanager
def weight_tma(enabled: bool) -> Iterator[None]:
    """Force the expert weights' tiles through TMA descriptors (True, also under the CPU
    interpreter) or through pointer loads (False) for the calls made inside: for A/B benchmarks
    and tests. Outside, `_weight_descriptor` decides. Process-wide."""
    global _weight_tma
    before, _weight_tma = _weight_tma, enabled
    try:
        yield
    finally:
        _weight_tma = before


def _weight_descriptor(b: torch.Tensor, cfg: dict[str, int]) -> TensorDescriptor | None:
    """A descriptor over B's rows (E * rows, K) for the GEMM's (BLOCK_N, BLOCK_K) tiles, or None
    for pointer loads. By default (see `weight_tma`) only compiled on NVIDIA sm_90 and later,
    for tensor-core tiles (BLOCK_M >= 64, prefill sizes), where TMA speeds up the GEMMs;
    decode tiles gain nothing from it and FP8 ones lose. TMA also needs every row 16-byte
    aligned."""
    use = _weight_tma
    if use is None:
        use = (
            cfg["BLOCK_SIZE_M"] >= 64
            and b.is_cuda
            and not _interpreting()
            and sm90_or_later(b.device)
        )
    if not use or not b.is_contiguous():
        return None
    k = b.shape[2]
    if (k * b.element_size()) % 16 or b.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(b.view(-1, k), [cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]])


def _launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor,
    n: int,
    top_k: int,
    gated: bool,
    per_channel: bool,
    cfg: dict[str, int],
    out: torch.Tensor | None = None,
) -> None:
    """One grouped GEMM: gate-up (`gated`, A rows = slot // top_k) or down (A rows = slots);
    given `out`, the down GEMM also sums each token's top_k rows of `c` into it. `align` is
    moe_align_block_size's result, or the flat topk_ids to give every slot a block of its own
    (one token: nothing to sort, and its top_k experts are distinct, so no weight is read
    twice; repeated ids would still sum correctly)."""
    k = a.shape[1]
    bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    slot_blocks = isinstance(align, torch.Tensor)
    if slot_blocks:
        sorted_ids = expert_ids = num_post_padded = align
        max_padded = align.numel() * bm
    else:
        sorted_ids, expert_ids, num_post_padded = align
        max_padded = sorted_ids.numel()
    grid = ((max_padded // bm) * triton.cdiv(n, bn),)
    fp8 = b.dtype == FP8_DTYPE
    counters = c  # unused unless out is given
    if out is not None:
        _, counters = _COUNTERS.get(c.device, 0, triton.cdiv(n, bn))
    desc = _weight_descriptor(b, cfg)
    _moe_gemm_kernel[grid](
        a,
        b,
        b if desc is None else desc,
        c,
        a_scale if fp8 else topk_weights,
        b_scale if fp8 else topk_weights,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        out if out is not None else c,
        counters,
        top_k,
        n,
        k,
        topk_weights.numel(),
        max_padded,
        a.stride(0),
        b.stride(0),
        b.shape[1],
        b.stride(1),
        c.stride(0),
        b_scale.stride(0) if fp8 and per_channel else 1,
        A_ROW_DIV=top_k if gated else 1,
        GATED=gated,
        MUL_WEIGHT=not gated,
        SUM_TOPK=out is not None,
        SLOT_BLOCKS=slot_blocks,
        FP8=fp8,
        B_SCALE_PER_CHANNEL=per_channel,
        UPCAST_DOT=_interpreting() and not fp8,
        B_TMA=desc is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=cfg["BLOCK_SIZE_K"],
        GROUP_M=cfg["GROUP_SIZE_M"],
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )


def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """out (T, H) = sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x), SwiGLU experts."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"x must be (T, H) float16/bfloat16, unit-stride along H: {x.shape}")
    t, h = x.shape
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[2] != h or w1.shape[1] % 2:
        raise ValueError(f"w1 must be (E, 2I, {h}), got {tuple(w1.shape)}")
    e, two_i, _ = w1.shape
    inter = two_i // 2
    if w2.shape != (e, h, inter):
        raise ValueError(f"w2 must be ({e}, {h}, {inter}), got {tuple(w2.shape)}")
    if w1.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("w1 and w2 must be unit-stride along their last dimension")
    if w1.dtype != w2.dtype or w1.dtype not in (x.dtype, FP8_DTYPE):
        raise ValueError(f"w1/w2 must both be {x.dtype} or float8_e4m3fn: {w1.dtype}, {w2.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError("topk_weights and topk_ids must both be (T, k)")
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError("topk_ids must be int32 and topk_weights float32")
    top_k = topk_ids.shape[1]
    fp8 = w1.dtype == FP8_DTYPE
    per_channel = False
    if fp8:
        per_channel = _check_scale(w1_scale, e, two_i, "w1_scale")
        if _check_scale(w2_scale, e, h, "w2_scale") != per_channel:
            raise ValueError("w1_scale and w2_scale must both be per-tensor or per-channel")
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = config or get_config(t, e, inter, top_k, "fp8_w8a8" if fp8 else "bf16", x.device)
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    # One token: its slots need no sorting (one block each); the align launches would cost
    # about as much as a GEMM at this size.
    align = topk_ids.view(-1) if t == 1 else moe_align_block_size(topk_ids, e, cfg["BLOCK_SIZE_M"])

    inter_buf = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    a1, a1_scale = per_token_quant(x, FP8_DTYPE) if fp8 else (x, None)
    _launch(a1, w1, inter_buf, a1_scale, w1_scale, topk_weights, align, inter, top_k, True,
            per_channel, cfg)  # fmt: skip
    a2, a2_scale = per_token_quant(inter_buf, FP8_DTYPE) if fp8 else (inter_buf, None)
    down = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    fuse_sum = t * top_k <= FUSED_SUM_MAX_SLOTS
    _launch(a2, w2, down, a2_scale, w2_scale, topk_weights, align, h, top_k, False, per_channel,
            cfg, out if fuse_sum else None)  # fmt: skip
    if not fuse_sum:
        torch.sum(down.view(t, top_k, h), dim=1, out=out)
    return out


def fused_moe_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of `fused_moe`: a loop over experts in float32 (FP8 weights are
    dequantized; activations stay unquantized, so FP8 comparisons need a looser bound)."""
    e, two_i, h = w1.shape
    inter = two_i // 2

    def deq(w: torch.Tensor, s: torch.Tensor | None, i: int) -> torch.Tensor:
        wf = w[i].float()
        if s is None:
            return wf
        return wf * (s[i].float().reshape(-1, 1) if s.dim() == 2 else s[i].float())

    xf = x.float()
    out = torch.zeros_like(xf)
    for i in range(e):
        tok, j = torch.nonzero(topk_ids == i, as_tuple=True)
        if tok.numel() == 0:
            continue
        g_u = xf[tok] @ deq(w1, w1_scale, i).t()
        act = torch.nn.functional.silu(g_u[:, :inter]) * g_u[:, inter:]
        y = (act @ deq(w2, w2_scale, i).t()) * topk_weights[tok, j].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
