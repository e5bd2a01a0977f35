"""INT4 weight-only GEMM for small M (decode): split-K, one launch, weight streamed once.

Same function and layouts as `int4_matmul`:

    x (M, K) fp16/bf16 · W (K, N), W[k, n] = q[k, n] * scales[k // G, n] - zeros[k // G, n],
    q packed 8 per int32 along K in qweight (K // 8, N), nibble j of word i = row 8 i + j.

At M <= 16 the product is bound by reading qweight (K N / 2 bytes), so each program owns a
BLOCK_N column slice and a contiguous run of K (split-K) and reads every packed word once. The
arithmetic per weight is kept small enough to hide under that read:

- Nibbles are never shuffled into k order. The sum over k is order-free, so a tile of packed
  words (BLOCK_KP rows, BLOCK_N) is consumed one nibble position j at a time: nibble j of word
  row i is k = 8 i + j and meets the activation x[:, 8 i + j] (strided, tiny, cached).
- No integer-to-float conversions (a quarter-rate unit). A nibble is masked in place, at bit
  B = 8, 12 or 16 of the word or of the word shifted once, and OR-ed into the bits of 2**23
  (0x4B000000): as float32 that is f = 2**23 + q 2**B exactly. Then one FMA gives the weight:
  w = q s - z = f (s 2**-B) - (2**(23 - B) s + z), with the two factors computed once per
  group. Rounding the second factor costs at most 2**-(B + 1) s: under the 16-bit rounding
  that w gets before a dot.

Two kernels: M == 1 runs on the CUDA cores, a (BLOCK_KP, BLOCK_N) float32 accumulator reduced
over packed rows once at the end, with the next step's words and scales loaded before the
current step is computed (register double buffering: these loads feed no dot, so Triton's
pipeliner leaves them alone). For bfloat16 activations on NVIDIA GPUs the products of a word
are formed two at a time in bf16x2 registers by a few lines of PTX (`_BF16X2_DOT8`: about two
instructions per weight; the products are rounded to bf16, so the result is coarser than the
float32 path's) and their sum is scaled in float32, W x = s sum(q x) - z sum(x); otherwise
each weight is dequantized in float32 as above. 1 < M <= 16 runs on the tensor cores with the
operands swapped: out^T = W^T x^T, so the dequantized (BLOCK_N, 8 BLOCK_KP) weight tile, its
eight nibble positions joined back into k order in registers, is the dot's first operand
(Hopper's wgmma reads it from registers) and x^T (8 BLOCK_KP, 16 tokens) the second, loaded
contiguously and staged through shared memory by the pipeliner. (With x as the first operand,
every nibble position's activation slice would cross shared memory, with two barriers, on its
way into the dot; swapped, one exchange of the weight tile per step remains.)

On NVIDIA GPUs from sm_80 on, every M <= 16 runs `int4_mma` instead, a faster Gluon kernel
whose weight registers are the tensor-core operand as loaded (no shared memory); the kernels
here stay for other GPUs and the CPU interpreter.

Split-K partial sums meet in a float32 workspace by atomic adds; the last program to finish a
column slice (per-slice arrival counter) reads the sums at L2, writes `out` in the activation
dtype and zeroes the slice's sums and its counter. The workspace is therefore all zeros between
calls and one launch does the whole product. Calls sharing a device's workspace must be ordered
(one stream, as the engine runs); CUDA-graph capture is fine once the workspace is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfleet.kernels.int4_mma import MmaConfig, int4_mma, mma_supported
from llmfleet.kernels.triton_utils import (
    ZeroedWorkspace,
    even_split,
    interpreting,
    launchable,
    nvidia_sm80,
)

MAX_M = 16  # the launcher serves M <= MAX_M; larger M takes int4_matmul's tensor-core tiles
_MAGIC = 0x4B000000  # float32 bits of 2**23: a nibble OR-ed into bits 0..19 stays exact


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_kp: int  # packed rows (8 k each) per loop step; >= 2 for the dot kernel (K >= 16)
    split_k: int
    dot: bool  # tensor-core kernel (any M <= 16) or the float32 one (M == 1)
    num_warps: int = 4
    num_stages: int = 1  # Triton's pipelining; the FMA kernel double-buffers by itself
    packed: bool = False  # M == 1, bf16: bf16x2 products (_BF16X2_DOT8) instead of float32


@triton.jit
def _nibble(src, s_b, c_b, magic, B: tl.constexpr):
    """Weights (float32) from the nibbles at bits B..B+3 of `src`: f * s_b - c_b with
    s_b = s 2**-B and c_b = 2**(23 - B) s + z. `magic` (0x4B000000) is passed at run time so
    it sits in a register: one LOP3 takes a single immediate, the mask."""
    bits = (src & (0xF << B)) | magic
    return bits.to(tl.float32, bitcast=True) * s_b - c_b


@triton.jit
def _weights(words, s, z, magic, J: tl.constexpr):
    """The weights of nibble position J (k = 8 i + J) of (BLOCK_KP, BLOCK_N) words.

    Nibbles 0, 1 sit at bits 8, 12 of words << 8; 2, 3, 4 at 8, 12, 16 of words; 5, 6, 7 at
    8, 12, 16 of words >> 12 (arithmetic: sign copies land above bit 19 and are masked off).
    The shifted copies are common subexpressions across J."""
    if J < 2:
        src = words << 8
        B: tl.constexpr = 8 + 4 * J
    elif J < 5:
        src = words
        B: tl.constexpr = 4 * J
    else:
        src = words >> 12
        B: tl.constexpr = 4 * J - 12
    return _nibble(src, s * (1.0 / (1 << B)), s * (1 << (23 - B)) + z, magic, B)


@triton.jit
def _load_step(
    qw_ptr, scales_ptr, zeros_ptr, step, limit, offs_p, offs_n, n_ok, stride_qk, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_KP: tl.constexpr,
):  # fmt: skip
    """Words (BKP, BN) int32 and scales/zeros (BKP, BN) of one K step; packed rows
    from `limit` on read as zeros (a step past the program's range loads nothing)."""
    p = step * BLOCK_KP + offs_p
    p_ok = p < limit
    words = tl.load(
        qw_ptr + p[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
        mask=p_ok[:, None] & n_ok[None, :],
        other=0,
    )
    # Scales and zeros per packed row, even when the whole step lies in one group: loading
    # them in the words' own layout (repeats hit L1) avoids a shared-memory layout exchange
    # with two barriers per derived factor.
    g_off = ((p * 8) // GROUP_SIZE)[:, None].to(tl.int64) * stride_sg + offs_n[None, :]
    ok = p_ok[:, None] & n_ok[None, :]
    s = tl.load(scales_ptr + g_off, mask=ok, other=0.0)
    z = tl.load(zeros_ptr + g_off, mask=ok, other=0.0)
    return words, s, z


@triton.jit
def _splitk_store(
    acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_m, pid_n,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    o_off = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        ws_off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.atomic_add(ws_ptr + ws_off, acc, mask=o_mask, sem="relaxed")
        # Every thread's adds are issued before one thread's release-increment of the counter.
        tl.debug_barrier()
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last split of this tile: all partial sums are in
            tl.debug_barrier()
            # Read the sums at L2 (an atomic add of 0), then re-arm workspace and counter.
            zero = tl.zeros_like(acc)
            total = tl.atomic_add(ws_ptr + ws_off, zero, mask=o_mask, sem="relaxed")
            tl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.store(ws_ptr + ws_off, zero, mask=o_mask)
            tl.store(counter, 0)


# One packed word (8 nibbles, k = 8 p + j) times its 8 bf16 activations, with bf16x2 math:
# $1 the word, $2..$5 the activation pairs (x[8 p + j] low, x[8 p + j + 4] high) for j = 0..3.
# (word >> 4 j) & 0x000F000F puts nibbles j and j + 4 in the two halves; OR-ed into 0x4300
# (bf16 128.0) each half is 128 + q exactly; one FMA (v * 1 - 128) gives q, exact; one FMA
# accumulates q * x, rounded to bf16 (8 bits) per product and per sum of four. The two
# halves then leave as one float32 (their sum). Two instructions per weight plus a shift per
# pair, where the float32 path spends about 5.7.
def _bf16x2_dot8_ptx() -> str:
    pairs = []
    for j in range(4):  # nibbles j and j + 4 of $1 against the activation pair in $(2 + j)
        shift = f"shr.u32 t, $1, {4 * j};\n" if j else ""
        src = "t" if j else "$1"
        pairs.append(
            f"{shift}lop3.b32 v, {src}, m, c, 0xEA;\n"
            "fma.rn.bf16x2 q, v, one, off;\n"
            f"fma.rn.bf16x2 a, q, ${2 + j}, a;\n"
        )
    return (
        "{\n.reg .b32 t, v, q, a, one, off, m, c;\n"
        "mov.b32 one, 0x3F803F80;\nmov.b32 off, 0xC300C300;\n"
        "mov.b32 m, 0x000F000F;\nmov.b32 c, 0x43004300;\nmov.b32 a, 0;\n"
        + "".join(pairs)
        + "shl.b32 t, a, 16;\nand.b32 a, a, 0xFFFF0000;\nadd.f32 $0, t, a;\n}"
    )


_BF16X2_DOT8 = tl.constexpr(_bf16x2_dot8_ptx())


@triton.jit
def _bf16_bits(v):
    """float32 value of the bf16 held in the low 16 bits of int32 v."""
    return (v << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dot8_bf16x2(words, pairs0, pairs1, pairs2, pairs3, USE_ASM: tl.constexpr):
    """sum over j of q_j * x_j for each packed word (see _BF16X2_DOT8). Without PTX (the CPU
    interpreter) the same sum in float32."""
    if USE_ASM:
        bits = tl.inline_asm_elementwise(
            _BF16X2_DOT8, "=r,r,r,r,r,r", [words, pairs0, pairs1, pairs2, pairs3],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        return bits.to(tl.float32, bitcast=True)
    total = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        pairs = pairs0 if j == 0 else pairs1 if j == 1 else pairs2 if j == 2 else pairs3
        q_lo = ((words >> (4 * j)) & 0xF).to(tl.float32)
        q_hi = ((words >> (4 * j + 16)) & 0xF).to(tl.float32)
        total += q_lo * _bf16_bits(pairs) + q_hi * _bf16_bits(pairs >> 16)
    return total


@triton.jit
def _int4_gemv_fma_kernel(
    x_ptr,  # x (1, K) viewed as int32 (1, K // 2): word h of x holds k = 2h (low), 2h + 1
    qw_ptr, scales_ptr, zeros_ptr, out_ptr, ws_ptr, cnt_ptr, N, K,
    stride_qk,  # int32 words between packed rows of qweight (K // 8, N); unit stride along N
    stride_sg,  # elements between group rows of scales and zeros (K // G, N); unit stride along N
    magic,
    GROUP_SIZE: tl.constexpr, SPLIT_K: tl.constexpr, X_BF16: tl.constexpr,
    PACKED: tl.constexpr,  # bf16 x: products in bf16x2 (see _BF16X2_DOT8), sums in float32
    USE_ASM: tl.constexpr,  # PACKED through inline PTX (False: the interpreter's emulation)
    BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N  # a mask, not clamped columns: keeps the weight loads 16 bytes wide
    offs_p = tl.arange(0, BLOCK_KP)
    kp_total = K // 8
    steps = tl.cdiv(kp_total, BLOCK_KP)
    per_split = tl.cdiv(steps, SPLIT_K)
    step = pid_k * per_split
    step_end = min(step + per_split, steps)

    limit = min(step_end * BLOCK_KP, kp_total)  # this program's packed rows end here
    acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)  # per packed row i
    words, s, z = _load_step(
        qw_ptr, scales_ptr, zeros_ptr, step, limit, offs_p, offs_n, n_ok, stride_qk, stride_sg,
        GROUP_SIZE, BLOCK_KP,
    )  # fmt: skip
    while step < step_end:
        # Issue the next step's loads first; they land while this step computes.
        nxt_words, nxt_s, nxt_z = _load_step(
            qw_ptr, scales_ptr, zeros_ptr, step + 1, limit, offs_p, offs_n, n_ok, stride_qk,
            stride_sg, GROUP_SIZE, BLOCK_KP,
        )  # fmt: skip
        p = step * BLOCK_KP + offs_p
        p_ok = p < kp_total
        sf = s.to(tl.float32)
        zf = z.to(tl.float32)
        if PACKED:
            # W x over a word = s sum(q x) - z sum(x): the q x sum in bf16x2, the rest here.
            xw0 = tl.load(x_ptr + p * 4, mask=p_ok, other=0)  # x[8p] low, x[8p + 1] high
            xw1 = tl.load(x_ptr + p * 4 + 1, mask=p_ok, other=0)
            xw2 = tl.load(x_ptr + p * 4 + 2, mask=p_ok, other=0)
            xw3 = tl.load(x_ptr + p * 4 + 3, mask=p_ok, other=0)
            low = 65535
            part = _dot8_bf16x2(
                words,
                ((xw0 & low) | (xw2 << 16))[:, None],  # x[8p + 0], x[8p + 4]
                (((xw0 >> 16) & low) | (xw2 & -65536))[:, None],  # x[8p + 1], x[8p + 5]
                ((xw1 & low) | (xw3 << 16))[:, None],  # x[8p + 2], x[8p + 6]
                (((xw1 >> 16) & low) | (xw3 & -65536))[:, None],  # x[8p + 3], x[8p + 7]
                USE_ASM,
            )  # fmt: skip
            xsum = (
                _bf16_bits(xw0) + (xw0 & -65536).to(tl.float32, bitcast=True)
                + _bf16_bits(xw1) + (xw1 & -65536).to(tl.float32, bitcast=True)
                + _bf16_bits(xw2) + (xw2 & -65536).to(tl.float32, bitcast=True)
                + _bf16_bits(xw3) + (xw3 & -65536).to(tl.float32, bitcast=True)
            )  # fmt: skip
            acc += sf * part - zf * xsum[:, None]
        else:
            for h in tl.static_range(4):  # x[8p + 2h], x[8p + 2h + 1] in one 32-bit load
                xw = tl.load(x_ptr + p * 4 + h, mask=p_ok, other=0)  # (BKP,) int32
                if X_BF16:
                    x_lo = (xw << 16).to(tl.float32, bitcast=True)
                    x_hi = (xw & -65536).to(tl.float32, bitcast=True)
                else:
                    x_lo = (xw & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                    x_hi = (xw >> 16 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
                    x_hi = x_hi.to(tl.float32)
                acc += x_lo[:, None] * _weights(words, sf, zf, magic, 2 * h)
                acc += x_hi[:, None] * _weights(words, sf, zf, magic, 2 * h + 1)
        words, s, z = nxt_words, nxt_s, nxt_z
        step += 1
    total = tl.sum(acc, axis=0)[None, :]  # (1, BN)
    _splitk_store(
        total, out_ptr, ws_ptr, cnt_ptr, tl.arange(0, 1), offs_n, 1, N, N, 0, pid_n, SPLIT_K
    )


@triton.jit
def _int4_gemv_dot_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
    stride_xm,  # elements between rows of x (M, K); unit stride along K
    stride_qk,  # int32 words between packed rows of qweight (K // 8, N); unit stride along N
    stride_sg,  # elements between group rows of scales and zeros (K // G, N); unit stride along N
    stride_om,  # elements between rows of out (M, N); unit stride along N
    magic,
    GROUP_SIZE: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # float32 dot operands: the CPU interpreter mis-multiplies bf16
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):  # fmt: skip
    """out^T (BN, BM) += W^T (BN, 8 BKP) @ x^T (8 BKP, BM) per K step: the weights are the
    dot's first operand, so wgmma reads them from registers, and x^T is loaded straight from
    memory (contiguous along K: staged through shared memory by the pipeliner)."""
    BLOCK_K: tl.constexpr = 8 * BLOCK_KP
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_p = tl.arange(0, BLOCK_KP)
    offs_k = tl.arange(0, BLOCK_K)
    kp_total = K // 8
    steps = tl.cdiv(kp_total, BLOCK_KP)
    per_split = tl.cdiv(steps, SPLIT_K)
    step_begin = pid_k * per_split
    step_end = min(step_begin + per_split, steps)
    dot_ty = x_ptr.dtype.element_ty

    xt_base = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm  # (1, BM): columns of x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # a tile of out^T
    for step in range(step_begin, step_end):
        p = step * BLOCK_KP + offs_p
        w_ok = n_ok[:, None] & (p < kp_total)[None, :]
        words = tl.load(
            qw_ptr + p[None, :].to(tl.int64) * stride_qk + offs_n[:, None], mask=w_ok, other=0
        )  # (BN, BKP)
        if BLOCK_K > GROUP_SIZE:  # per packed row: group 8 p // G (8 divides G)
            g_off = ((p * 8) // GROUP_SIZE)[None, :].to(tl.int64) * stride_sg + offs_n[:, None]
            s = tl.load(scales_ptr + g_off, mask=w_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g_off, mask=w_ok, other=0.0).to(tl.float32)
        else:  # the whole step lies in one group
            g_off = (step * BLOCK_K) // GROUP_SIZE * stride_sg + offs_n
            s = tl.load(scales_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            z = tl.load(zeros_ptr + g_off, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        # Nibble position j of packed row p is k = 8 p + j. Three levels of joins give
        # element [n, p, a, b, c] = w_{4a + 2b + c}[n, p], so the reshape below puts it in
        # column 8 p + 4 a + 2 b + c: natural k order, one dot for the whole step.
        w = tl.join(
            tl.join(
                tl.join(_weights(words, s, z, magic, 0), _weights(words, s, z, magic, 4)),
                tl.join(_weights(words, s, z, magic, 2), _weights(words, s, z, magic, 6)),
            ),
            tl.join(
                tl.join(_weights(words, s, z, magic, 1), _weights(words, s, z, magic, 5)),
                tl.join(_weights(words, s, z, magic, 3), _weights(words, s, z, magic, 7)),
            ),
        )
        w = tl.reshape(w.to(dot_ty), (BLOCK_N, BLOCK_K))
        k = step * BLOCK_K + offs_k
        xt = tl.load(xt_base + k[:, None], mask=m_ok[None, :] & (k < K)[:, None], other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
    _splitk_store(
        tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_m, pid_n,
        SPLIT_K,
    )  # fmt: skip


def default_gemv_config(
    m: int, n: int, k: int, group_size: int, dtype: torch.dtype = torch.bfloat16
) -> GemvConfig:
    """Block shape and split for M <= 16, tuned on 8B-class projection shapes (groups of 32
    and 128) for 132-SM parts. M == 1 takes the CUDA-core kernel with 64-column slices split
    to about 7 programs per SM: for bfloat16 with bf16x2 products and 32 packed rows per step
    on long K, else in float32 with 16. Larger M takes the tensor-core kernel: 64 columns (128
    for groups of 32, whose per-row scales make narrow tiles dearer), 16 packed rows per step,
    4 warps, 3 stages, split to about 3 programs per SM."""
    if m == 1:
        packed = dtype == torch.bfloat16 and packed_products_supported()
        block_kp = 32 if packed and k >= 8192 else 16
        return GemvConfig(64, block_kp, split_k(m, n, k, 64, block_kp, 7), False, 4, 1, packed)
    block_n = 128 if group_size < 64 else 64
    return GemvConfig(block_n, 16, split_k(m, n, k, block_n, 16, 3), True, 4, 3)


def split_k(m: int, n: int, k: int, block_n: int, block_kp: int, per_sm: float) -> int:
    """The K split that brings the grid to about `per_sm` programs per SM of a 132-SM part:
    for M == 1 the largest power of two not past it (the splits its configs were tuned with),
    for the dot kernel the nearest count, evened out so no split is empty."""
    steps = triton.cdiv(k // 8, block_kp)
    if m == 1:
        tiles = triton.cdiv(n, block_n)
        split = 1
        while tiles * split * 2 <= per_sm * 132 and split * 2 <= steps:
            split *= 2
        return split
    return even_split(steps, triton.cdiv(n, block_n) * triton.cdiv(m, 16), per_sm)


_WORKSPACE = ZeroedWorkspace("int4 split-K")


def packed_products_supported() -> bool:
    """bf16x2 products take inline PTX (`fma.rn.bf16x2`, sm_80 on): NVIDIA GPUs from Ampere
    on, or the CPU interpreter (which runs the kernel's float32 emulation of them)."""
    return interpreting() or nvidia_sm80()


def int4_gemv(
    x: torch.Tensor,  # (M, K) fp16/bf16, M <= 16, unit stride along K
    qweight: torch.Tensor,  # (K // 8, N) int32
    scales: torch.Tensor,  # (K // G, N) x.dtype
    zeros: torch.Tensor,  # (K // G, N) x.dtype
    group_size: int,
    config: GemvConfig | MmaConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N) x.dtype, unit stride along N: written in place
) -> torch.Tensor:
    """out (M, N) = x @ W for M <= 16. `int4_matmul` validates the layouts and calls this for
    small M; direct callers pass the same checked tensors. By default every M runs `int4_mma`
    (Gluon, mma.sync, no shared memory) where it is supported, the kernels here otherwise."""
    m, k = x.shape
    n = qweight.shape[1]
    if m > MAX_M:
        raise ValueError(f"int4_gemv serves M <= {MAX_M}, got M={m}")
    if isinstance(config, MmaConfig):
        if not mma_supported(x.dtype):
            raise ValueError("int4_mma needs Gluon and an NVIDIA GPU of sm_80 or later")
        return int4_mma(x, qweight, scales, zeros, group_size, config, out)
    if config is None and mma_supported(x.dtype):
        return int4_mma(x, qweight, scales, zeros, group_size, out=out)
    cfg = config or default_gemv_config(m, n, k, group_size, x.dtype)
    if cfg.packed and x.dtype == torch.bfloat16 and not packed_products_supported():
        raise ValueError("packed bf16x2 products need an NVIDIA GPU of sm_80 or later")
    if cfg.dot and cfg.block_kp < 2:
        raise ValueError(f"block_kp={cfg.block_kp} is too small for a dot (>= 2: K >= 16)")
    if not cfg.dot and m > 1:
        raise ValueError(f"the float32 kernel serves M == 1, got M={m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    block_m = 16 if cfg.dot else 1
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), cfg.split_k)
    ws, cnt = _WORKSPACE.get(x.device, m * n, grid[0] * grid[1])
    sizes = dict(BLOCK_N=cfg.block_n, BLOCK_KP=cfg.block_kp)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    common = (qweight, scales, zeros, out, ws, cnt)
    if not cfg.dot:
        xw = x.contiguous().view(torch.int32)  # K is a multiple of the group: even
        launchable(_int4_gemv_fma_kernel)[(grid[0], grid[2])](
            xw, *common, n, k, qweight.stride(0), scales.stride(0), _MAGIC,
            GROUP_SIZE=group_size, SPLIT_K=cfg.split_k, X_BF16=x.dtype == torch.bfloat16,
            PACKED=cfg.packed and x.dtype == torch.bfloat16, USE_ASM=not interpreting(),
            **sizes, **launch,
        )  # fmt: skip
    else:
        launchable(_int4_gemv_dot_kernel)[grid](
            x, *common, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0), _MAGIC,
            GROUP_SIZE=group_size, SPLIT_K=cfg.split_k, UPCAST_DOT=interpreting(),
            BLOCK_M=block_m, **sizes, **launch,
        )  # fmt: skip
    return out
