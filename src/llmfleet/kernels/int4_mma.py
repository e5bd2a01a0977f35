"""INT4 weight-only GEMM for 1 < M <= 16 on mma.sync, written in Gluon: no shared memory at all.

Same function and layouts as `int4_matmul`:

    x (M, K) fp16/bf16 · W (K, N), W[k, n] = q[k, n] * scales[k // G, n] - zeros[k // G, n],
    q packed 8 per int32 along K in qweight (K // 8, N), nibble j of word i = row 8 i + j.

Computed as out^T (N, M) = W^T (N, K) x^T (K, M) with m16n8k16 tensor-core instructions whose
first operand, a 16 x 16 tile of W^T, is held in registers: lane (g, t) = (lane // 4, lane % 4)
holds rows g, g + 8 and columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-column chunk. A dot
product does not care in which order its k terms come, so the kernel gives the instruction a
*permuted* k (and n) order chosen so that a lane's operand registers are exactly the nibbles of
the words it loaded itself; x^T is loaded in the same permuted order. Nothing crosses lanes or
shared memory on the way from a 16-byte load of packed words to the tensor core:

    k order the instruction sees, per block of 32:  L = 16 ch + 8 h8 + 2 t + odd
    real k of that slot:                            8 t + 4 odd + 2 ch + h8
                                                    (word t of the block, nibble 4 odd + 2 ch + h8)

so lane t of a block owns word t, and the nibble pair (i, i + 4) of a word (i = 2 ch + h8) is
one 32-bit operand register: `(word >> 4 i) & 0x000F000F | 0x43004300` is (128 + q_i, 128 +
q_{i+4}) as bf16x2 (0x6400: 1024 + q as f16x2), then two packed FMAs give q s - z
(`_nibbles_ptx`, inline PTX; no FMAs at all with the scales after the dot, below). Rows are
permuted the same way, so a lane loads 2 REP consecutive columns n of a packed row in one
vector load:

    real n = 16 REP w + 2 REP g + 2 rep + h    for warp w, lane row g, repeat rep, half h
    row of the instruction tile = 16 WARPS rep + 16 w + 8 h + g

The tensors are loaded in hand-written linear layouts and turned into the operand layouts by
joins, reshapes and permutes that Gluon proves to be register renamings (`assert_trivial`).
The next K step's words, scales and x are loaded before the current step is computed (register
double buffering); a program's last step prefetches itself again rather than the step after it,
and x rows past M read row M - 1, so where K is a whole number of steps and N of column tiles
(`EVEN_K`, `EVEN_N`: with the default shape, K a multiple of 128 and N of 64, as in the
projections of 8B-class models; not SmolLM2's hidden 576) no load carries a mask. Each
column's scale and negated zero are paired into a bf16x2 register once per step, not once per
word. With split-K, every program stores its partial sums to a scratch slab of its own, with
16-byte stores (the sums renamed in registers so that each lane holds four consecutive), not
float32 atomic adds, which cost more than the slab round trip; the last program of a column
tile to arrive adds the slabs in split order, so the result does not depend on the order of
arrival (slabs and counters are per device, so calls on one device must be ordered: one
stream, as the engine runs). The split is chosen per call
(`MmaConfig.split_k` 0) from how many programs of the compiled kernel fit on an SM, so that
the grid does not spill a few programs into a second wave (`triton_utils.wave_split`).

Up to 8 rows (`default_mma_config`), where a step lies in one group, the weights are not
dequantized before the dot at all (`MmaConfig.scales_after`): the first operand is magic + q
as the LOP3 leaves it (128 + q in bf16, 1024 + q in fp16, both exact), an all-ones operand
against the same x gives every row's sum(x) for the step, and the float32 sums take the
group's scale and zero afterwards, per column:

    sum_k (q s - z) x = s sum_k (c + q) x - (c s + z) sum_k x        (c the magic)

That drops the two packed FMAs per pair of weights for two float32 FMAs per output sum and
step, and the weights are not rounded to 16 bits before the dot, so the result is closer to
the float32 reference.

Needs an NVIDIA GPU of sm_80 or later and Triton with Gluon (run on 3.6, compiled on 3.9);
`int4_gemv` serves everything else (current timings: docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

try:  # Gluon is experimental: a Triton without it leaves this path off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from llmfleet.kernels.triton_utils import ZeroedWorkspace, interpreting, nvidia_sm80, wave_split

MAX_M = 16


def _nibbles_ptx(fp16: bool, scaled: bool) -> str:
    """$8 a packed word -> $0..$7 nibbles 0..7, nibble i and i + 4 formed together in one 32-bit
    register: magic + q (exact; one LOP3, and a shift, per pair), or with `scaled`, given $9
    its scale and $10 its negated zero, each twice in a 32-bit register (`_PACK_SCALE`,
    `_PACK_NEG_ZERO`), the weights q s - z."""
    magic, one, off, fma = (
        ("0x64006400", "0x3C003C00", "0xE400E400", "fma.rn.f16x2")  # 1024.0, 1.0, -1024.0
        if fp16
        else ("0x43004300", "0x3F803F80", "0xC300C300", "fma.rn.bf16x2")  # 128.0, 1.0, -128.0
    )
    body = []
    for i in range(4):
        src = "$8"
        if i:
            body.append(f"shr.u32 t, $8, {4 * i};")
            src = "t"
        body.append(f"lop3.b32 v, {src}, m, c, 0xEA;")  # (src & m) | c: halves magic + q
        if scaled:
            body.append(f"{fma} q, v, one, off;")  # q, exact
            body.append(f"{fma} v, q, $9, $10;")  # q s - z, rounded once
        body.append(f"mov.b32 {{${i}, ${i + 4}}}, v;")
    regs, consts = "t, v, m, c", f"mov.b32 m, 0x000F000F;\nmov.b32 c, {magic};\n"
    if scaled:
        regs += ", q, one, off"
        consts += f"mov.b32 one, {one};\nmov.b32 off, {off};\n"
    return f"{{\n.reg .b32 {regs};\n{consts}" + "\n".join(body) + "\n}"


# $1 a 16-bit scale (zero) -> $0 the scale (the negated zero) in both halves, made once per
# column and step rather than once per packed word
_PACK_SCALE = "mov.b32 $0, {$1, $1};"
_PACK_NEG_ZERO = "{\n.reg .b16 n;\nxor.b16 n, $1, 0x8000;\nmov.b32 $0, {n, n};\n}"


@dataclass(frozen=True)
class MmaConfig:
    warps: int  # warps per program, stacked along N
    rep: int  # 16-row tiles per warp (1 or 2): each lane loads 2 rep consecutive columns
    blocks: int  # blocks of 32 k per step (a power of two)
    split_k: int = 0  # 0: chosen per call so the grid is one wave of the programs that fit
    # dot of the raw nibbles (magic + q), scales and zeros applied to its float32 sums after,
    # where every step lies in one group (G a multiple of 32 blocks); else dequantize first
    scales_after: bool = False
    max_regs: int = 0  # ptxas register limit per thread (maxnreg); 0: ptxas chooses

    def __post_init__(self) -> None:
        if self.warps not in (1, 2, 4, 8) or self.rep not in (1, 2):
            raise ValueError(f"warps must be 1, 2, 4 or 8 and rep 1 or 2, got {self}")
        if self.blocks not in (1, 2, 4, 8) or self.split_k < 0:
            raise ValueError(f"blocks must be 1, 2, 4 or 8 and split_k >= 0, got {self}")
        if self.max_regs and not 32 <= self.max_regs <= 255:
            raise ValueError(f"max_regs must be 0 or 32..255, got {self}")

    @property
    def block_n(self) -> int:
        return 16 * self.warps * self.rep

    def steps(self, k: int) -> int:
        """K steps of a K-long product (4 packed words of 8 k per block)."""
        return triton.cdiv(k // 8, 4 * self.blocks)

    def scales_after_dot(self, group_size: int) -> bool:
        """Whether this config takes the scales-after path for groups of `group_size`."""
        return self.scales_after and group_size % (32 * self.blocks) == 0


if HAVE_GLUON:
    _DEQUANT_BF16 = gl.constexpr(_nibbles_ptx(False, scaled=True))
    _DEQUANT_F16 = gl.constexpr(_nibbles_ptx(True, scaled=True))
    _DEQUANT_IO = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")  # 8 weights <- word, s, -z
    _RAW_BF16 = gl.constexpr(_nibbles_ptx(False, scaled=False))
    _RAW_F16 = gl.constexpr(_nibbles_ptx(True, scaled=False))
    _RAW_IO = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r")  # 8 x (magic + q) <- word
    _PACK_S = gl.constexpr(_PACK_SCALE)
    _PACK_NZ = gl.constexpr(_PACK_NEG_ZERO)
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after triton 3.6

    @gluon.constexpr_function
    def _words_layout(warps, rep, blocks):
        """(BLOCK_N, 4 BLOCKS) packed words; lane (g, t) holds word t of every block for the
        2 REP consecutive columns 2 REP g .. of its warp's 16 REP."""
        regs = [[1, 0]] + ([[2, 0]] if rep == 2 else [])
        regs += [[0, 4 << i] for i in range(int(math.log2(blocks)))]
        lanes = [[0, 1], [0, 2]] + [[2 * rep << i, 0] for i in range(3)]
        warp_bases = [[16 * rep << i, 0] for i in range(int(math.log2(warps)))]
        return gl.DistributedLinearLayout(
            regs, lanes, warp_bases, [], [16 * warps * rep, 4 * blocks]
        )

    @gluon.constexpr_function
    def _x_layout(warps, block_m, blocks):
        """(BLOCK_M, 32 BLOCKS) activations; lane (g, t) holds the 8 consecutive k of word t of
        every block for rows g (and g + 8); every warp holds the whole tile."""
        regs = [[0, 1], [0, 2], [0, 4]] + [[0, 32 << i] for i in range(int(math.log2(blocks)))]
        regs += [[8, 0]] if block_m == 16 else []
        lanes = [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]]
        warp_bases = [[0, 0] for _ in range(int(math.log2(warps)))]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block_m, 32 * blocks])

    @gluon.constexpr_function
    def _flat_layout(warps, rep, nt):
        """(16 WARPS REP x 8 NT,) output sums in `_int4_mma_kernel`'s flat order: 4 consecutive
        per lane, lanes (g, t) 4 apart, then each lane's register quads, then warps."""
        regs = [[1], [2]] + [[128 << i] for i in range(int(math.log2(nt * rep)))]
        lanes = [[4], [8], [16], [32], [64]]
        warp_bases = [[128 * nt * rep << i] for i in range(int(math.log2(warps)))]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [128 * nt * rep * warps])

    @gluon.constexpr_function
    def _cols_layout(warps, rep):
        """(BLOCK_N,) scales or zeros by real column: lane (g, t) holds the 2 REP consecutive
        columns 2 REP g .. of its warp's 16 REP (one vector load), as the accumulator's rows."""
        regs = [[1]] + ([[2]] if rep == 2 else [])
        lanes = [[0], [0]] + [[2 * rep << i] for i in range(3)]
        warp_bases = [[16 * rep << i] for i in range(int(math.log2(warps)))]
        return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [16 * warps * rep])

    @gluon.jit
    def _acc_rows(v, row_layout: gl.constexpr, WARPS: gl.constexpr, REP: gl.constexpr):
        """(BN,) by real column (`_cols_layout`) -> by accumulator row (rep, w, h, g)."""
        t = v.reshape([WARPS, 8, REP, 2]).permute([2, 0, 3, 1]).reshape([16 * WARPS * REP])
        return gl.convert_layout(t, row_layout, assert_trivial=True)

    @gluon.jit
    def _weights_operand(words, s, z, a_layout: gl.constexpr, FP16: gl.constexpr,
                         WARPS: gl.constexpr, REP: gl.constexpr, BLOCKS: gl.constexpr):  # fmt: skip
        """(BN, 4 BLOCKS) words -> the (BN, 32 BLOCKS) first operand, rows and k permuted;
        s and z are a (BN,) vector per step, or (BN, 4 BLOCKS) for groups shorter than a step."""
        s2 = gl.inline_asm_elementwise(
            _PACK_S, "=r,h", [s.to(gl.int16, bitcast=True)], dtype=gl.int32, is_pure=True, pack=1
        )
        nz2 = gl.inline_asm_elementwise(
            _PACK_NZ, "=r,h", [z.to(gl.int16, bitcast=True)], dtype=gl.int32, is_pure=True, pack=1
        )
        if len(s.shape) == 1:  # broadcast along the step after packing: one pair per column
            s2 = gl.broadcast(s2[:, None], words)[0]
            nz2 = gl.broadcast(nz2[:, None], words)[0]
        args = [words, s2, nz2]
        if FP16:
            nibbles = gl.inline_asm_elementwise(
                _DEQUANT_F16, _DEQUANT_IO, args, dtype=(gl.int16,) * 8, is_pure=True, pack=1
            )
        else:
            nibbles = gl.inline_asm_elementwise(
                _DEQUANT_BF16, _DEQUANT_IO, args, dtype=(gl.int16,) * 8, is_pure=True, pack=1
            )
        return _operand(nibbles, a_layout, FP16, WARPS, REP, BLOCKS)

    @gluon.jit
    def _raw_operand(words, a_layout: gl.constexpr, FP16: gl.constexpr, WARPS: gl.constexpr,
                     REP: gl.constexpr, BLOCKS: gl.constexpr):  # fmt: skip
        """(BN, 4 BLOCKS) words -> the (BN, 32 BLOCKS) first operand magic + q (exact: 128 + q
        in bf16, 1024 + q in fp16), rows and k permuted as in `_weights_operand`."""
        if FP16:
            nibbles = gl.inline_asm_elementwise(
                _RAW_F16, _RAW_IO, [words], dtype=(gl.int16,) * 8, is_pure=True, pack=1
            )
        else:
            nibbles = gl.inline_asm_elementwise(
                _RAW_BF16, _RAW_IO, [words], dtype=(gl.int16,) * 8, is_pure=True, pack=1
            )
        return _operand(nibbles, a_layout, FP16, WARPS, REP, BLOCKS)

    @gluon.jit
    def _operand(nibbles, a_layout: gl.constexpr, FP16: gl.constexpr, WARPS: gl.constexpr,
                 REP: gl.constexpr, BLOCKS: gl.constexpr):  # fmt: skip
        """The 8 16-bit values of every word (nibble 0..7) -> the (BN, 32 BLOCKS) operand."""
        o0, o1, o2, o3, o4, o5, o6, o7 = nibbles
        # [..., odd, ch, h8] = nibble 4 odd + 2 ch + h8
        t = gl.join(
            gl.join(gl.join(o0, o4), gl.join(o2, o6)), gl.join(gl.join(o1, o5), gl.join(o3, o7))
        )
        # (w, g, rep, h) real columns, (b, t) words, (odd, ch, h8) nibbles
        t = t.reshape([WARPS, 8, REP, 2, BLOCKS, 4, 2, 2, 2])
        t = t.permute([2, 0, 3, 1, 4, 7, 8, 5, 6])  # -> rows (rep, w, h, g), k (b, ch, h8, t, odd)
        t = t.reshape([16 * WARPS * REP, 32 * BLOCKS])
        w = gl.convert_layout(t, a_layout, assert_trivial=True)
        return w.to(gl.float16 if FP16 else gl.bfloat16, bitcast=True)

    @gluon.jit
    def _x_operand(xt, b_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCKS: gl.constexpr):
        """(BLOCK_M, 32 BLOCKS) x -> the (32 BLOCKS, BLOCK_M) second operand, k permuted."""
        t = xt.reshape([BLOCK_M // 8, 8, BLOCKS, 4, 2, 2, 2])  # (mt, g) rows, (b, t, odd, ch, h8)
        t = t.permute([2, 5, 6, 3, 4, 0, 1])
        t = t.reshape([32 * BLOCKS, BLOCK_M])
        return gl.convert_layout(t, b_layout, assert_trivial=True)

    @gluon.jit
    def _load_step(
        x_ptr, qw_ptr, s_ptr, z_ptr, step, limit, w_off, n_ok, offs_c, x_off, offs_xk, offs_s,
        s_ok, stride_qk, stride_sg,
        GROUP_SIZE: gl.constexpr, BKW: gl.constexpr, EVEN_K: gl.constexpr, EVEN_N: gl.constexpr,
    ):  # fmt: skip
        """Words, scales, zeros and x of one K step, addressed as a scalar step base plus
        offsets fixed for the program. Unless the shape is even (EVEN_K, EVEN_N), packed rows
        from `limit` on and columns from N on read as zeros with zero scales (so they
        dequantize to 0, not to -z); x rows past M were clamped to row M - 1 by the caller.
        Scales and zeros are read at columns `offs_s` (valid where `s_ok`): the words' own
        columns, or with the scales after the dot, a vector in `_cols_layout`."""
        kw = step * BKW  # first packed row of the step
        qw = qw_ptr + kw.to(gl.int64) * stride_qk
        ok = n_ok[:, None] & ((kw + offs_c) < limit)[None, :]  # unused (and dropped) if even
        if GROUP_SIZE >= 8 * BKW:  # the step lies in one group: a vector per step
            g_off = ((kw * 8) // GROUP_SIZE) * stride_sg + offs_s
            g_ok = s_ok & (kw < limit)
        else:
            g_off = (((kw + offs_c) * 8) // GROUP_SIZE)[None, :].to(gl.int64) * stride_sg
            g_off = g_off + offs_s[:, None]
            g_ok = ok
        if EVEN_K and EVEN_N:
            words = gl.load(qw + w_off)
            s = gl.load(s_ptr + g_off)
            z = gl.load(z_ptr + g_off)
        else:
            words = gl.load(qw + w_off, mask=ok, other=0)
            s = gl.load(s_ptr + g_off, mask=g_ok, other=0.0)
            z = gl.load(z_ptr + g_off, mask=g_ok, other=0.0)
        xs = x_ptr + kw * 8
        if EVEN_K:
            xt = gl.load(xs + x_off)
        else:
            xt = gl.load(xs + x_off, mask=((kw * 8 + offs_xk) < limit * 8)[None, :], other=0.0)
        return words, s, z, xt

    @gluon.jit
    def _int4_mma_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
        stride_xm,  # elements between rows of x (M, K); unit stride along K
        stride_qk,  # int32 words between packed rows of qweight (K // 8, N); unit stride along N
        stride_sg,  # elements between group rows of scales, zeros (K // G, N); unit stride along N
        stride_om,  # elements between rows of out (M, N); unit stride along N
        GROUP_SIZE: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
        FP16: gl.constexpr, WARPS: gl.constexpr, REP: gl.constexpr, BLOCKS: gl.constexpr,
        EVEN_K: gl.constexpr,  # K // 8 is a whole number of steps
        EVEN_N: gl.constexpr,  # N is a whole number of column tiles
        SCALE_AFTER: gl.constexpr,  # dot of magic + q, scales applied after (G % step == 0)
    ):  # fmt: skip
        BN: gl.constexpr = 16 * WARPS * REP
        BKW: gl.constexpr = 4 * BLOCKS
        wl: gl.constexpr = _words_layout(WARPS, REP, BLOCKS)
        xl: gl.constexpr = _x_layout(WARPS, BLOCK_M, BLOCKS)
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, wl))  # real columns
        offs_c = gl.arange(0, BKW, layout=gl.SliceLayout(0, wl))
        n_ok = offs_n < N
        w_off = offs_c[None, :] * stride_qk + offs_n[:, None]  # words of step 0
        # rows past M read row M - 1 (their sums are not stored), so x needs no row mask
        offs_xm = gl.minimum(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl)), M - 1)
        offs_xk = gl.arange(0, 8 * BKW, layout=gl.SliceLayout(0, xl))
        x_off = offs_xm[:, None] * stride_xm + offs_xk[None, :]  # x of step 0
        if SCALE_AFTER:  # scales loaded by real column, used by accumulator row
            offs_s = pid_n * BN + gl.arange(0, BN, layout=_cols_layout(WARPS, REP))
            s_ok = offs_s < N
        else:  # scales in the words' layout
            offs_s = offs_n
            s_ok = n_ok
        kp_total = K // 8
        steps = gl.cdiv(kp_total, BKW)
        per_split = gl.cdiv(steps, SPLIT_K)
        step_begin = pid_k * per_split
        step_end = gl.minimum(step_begin + per_split, steps)
        limit = gl.minimum(step_end * BKW, kp_total)  # this program's packed rows end here

        acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma)  # out^T, rows permuted
        # a split without steps loads the last step and adds nothing; the step after a
        # program's last is never read (the prefetch repeats the last), so even shapes need
        # no masks at all
        words, s, z, xt = _load_step(
            x_ptr, qw_ptr, s_ptr, z_ptr, gl.minimum(step_begin, steps - 1), limit, w_off, n_ok,
            offs_c, x_off, offs_xk, offs_s, s_ok, stride_qk, stride_sg, GROUP_SIZE, BKW, EVEN_K,
            EVEN_N,
        )  # fmt: skip
        for step in range(step_begin, step_end):
            nxt_words, nxt_s, nxt_z, nxt_x = _load_step(
                x_ptr, qw_ptr, s_ptr, z_ptr, gl.minimum(step + 1, step_end - 1), limit, w_off,
                n_ok, offs_c, x_off, offs_xk, offs_s, s_ok, stride_qk, stride_sg, GROUP_SIZE, BKW,
                EVEN_K, EVEN_N,
            )  # fmt: skip
            if SCALE_AFTER:  # sum (q s - z) x = s sum((c + q) x) - (c s + z) sum(x), c = magic
                xb = _x_operand(xt, b_l, BLOCK_M, BLOCKS)
                zero = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma)
                part = mma_v2(_raw_operand(words, a_l, FP16, WARPS, REP, BLOCKS), xb, zero)
                ones = gl.full([BN, 32 * BLOCKS], 1.0, xb.dtype, layout=a_l)
                x_sum = mma_v2(ones, xb, zero)  # every row: sum(x) of the step
                sf = _acc_rows(s, gl.SliceLayout(1, mma), WARPS, REP).to(gl.float32)
                zf = sf * (1024.0 if FP16 else 128.0)
                zf += _acc_rows(z, gl.SliceLayout(1, mma), WARPS, REP).to(gl.float32)
                acc = acc + sf[:, None] * part - zf[:, None] * x_sum
            else:
                a = _weights_operand(words, s, z, a_l, FP16, WARPS, REP, BLOCKS)
                acc = mma_v2(a, _x_operand(xt, b_l, BLOCK_M, BLOCKS), acc)
            words, s, z, xt = nxt_words, nxt_s, nxt_z, nxt_x

        # the sums, renamed in registers into a flat order where each lane holds 4 consecutive
        # (16-byte stores and loads of the partial sums) and consecutive lanes hold the next 4:
        # tile rows (rep, w, h8, g) and columns (nt, t, c) -> (w, rep, nt, g, t, h8, c)
        tile: gl.constexpr = BN * BLOCK_M
        NT: gl.constexpr = BLOCK_M // 8
        fl: gl.constexpr = _flat_layout(WARPS, REP, NT)
        sums = acc.reshape([REP, WARPS, 2, 8, NT, 4, 2]).permute([1, 0, 4, 3, 5, 2, 6])
        sums = gl.convert_layout(sums.reshape([tile]), fl, assert_trivial=True)
        f = gl.arange(0, tile, layout=fl)
        rep = (f // (128 * NT)) % REP
        n = (pid_n * BN + (f // (128 * NT * REP)) * (16 * REP) + ((f // 16) % 8) * (2 * REP)
             + rep * 2 + (f // 2) % 2)  # fmt: skip
        m = 8 * ((f // 128) % NT) + 2 * ((f // 4) % 4) + f % 2
        o_mask = (m < M) & (n < N)
        o_off = m.to(gl.int64) * stride_om + n
        if SPLIT_K == 1:
            gl.store(out_ptr + o_off, sums.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            # each split stores its partial sums to a slab of its own (plain 16-byte stores,
            # cheaper than atomics); the last to arrive adds them in split order
            slab = ws_ptr + pid_n.to(gl.int64) * (SPLIT_K * tile)
            gl.store(slab + pid_k * tile + f, sums)
            _barrier()  # every thread's stores are issued before the counter's release
            counter = cnt_ptr + pid_n
            arrived = gl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last split of this column tile
                _barrier()
                total = gl.zeros_like(sums)
                for i in gl.static_range(SPLIT_K):  # all loads in flight at once; past L1
                    total += gl.load(slab + i * tile + f, cache_modifier=".cg")
                gl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=o_mask)
                gl.store(counter, 0)


def mma_supported(dtype: torch.dtype) -> bool:
    """Whether `int4_mma` runs here: Gluon, an NVIDIA GPU of sm_80 or later (mma.sync with
    bf16, packed bf16 FMAs), fp16/bf16 activations, and not the CPU interpreter."""
    return (
        HAVE_GLUON
        and dtype in (torch.float16, torch.bfloat16)
        and not interpreting()
        and nvidia_sm80()
    )


# 2 warps of 2 row tiles, 128 k per step, split per call: the best shape at M = 4 to 16 on
# 8B-class projections, for both group sizes. Up to 8 rows the scales go after the dot,
# compiled with at most 128 registers (left to itself ptxas allots fewer and the kernel runs
# slower); at 16 rows the extra float32 work per step outweighs the FMAs it saves.
DEFAULT_MMA_CONFIG = MmaConfig(2, 2, 4, 0)
DEFAULT_MMA_CONFIG_8 = MmaConfig(2, 2, 4, 0, scales_after=True, max_regs=128)


def default_mma_config(m: int) -> MmaConfig:
    """The config `int4_mma` runs for M rows when none is given."""
    return DEFAULT_MMA_CONFIG_8 if m <= 8 else DEFAULT_MMA_CONFIG


# split-K partial sums (scratch, written before read) and arrival counters (zero between calls)
_WORKSPACE = ZeroedWorkspace("int4_mma split-K")
_FIT: dict[tuple, tuple[int, int]] = {}  # (device, split, constexprs) -> (per SM, SMs)


def programs_per_sm(compiled, warps: int, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on one SM at once: its registers against
    the SM's register file (allocated per warp in units of 256) and thread limit."""
    compiled._init_handles()  # loads the binary: its register count is known from here on
    props = torch.cuda.get_device_properties(device)
    warp_regs = -(-compiled.n_regs // 8) * 8 * 32
    per_sm = min(
        getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * warps),
        getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
        32,
    )
    return max(1, per_sm)


def int4_mma(
    x: torch.Tensor,  # (M, K) fp16/bf16, M <= 16, unit stride along K
    qweight: torch.Tensor,  # (K // 8, N) int32
    scales: torch.Tensor,  # (K // G, N) x.dtype
    zeros: torch.Tensor,  # (K // G, N) x.dtype
    group_size: int,
    config: MmaConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N) x.dtype, unit stride along N: written in place
) -> torch.Tensor:
    """out (M, N) = x @ W. Callers (`int4_gemv`) pass tensors `int4_matmul` has checked and
    run this only where `mma_supported(x.dtype)`."""
    m, k = x.shape
    n = qweight.shape[1]
    if m > MAX_M:
        raise ValueError(f"int4_mma serves M <= {MAX_M}, got M={m}")
    cfg = config or default_mma_config(m)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    if k < 8:  # no packed row: an empty sum
        return out.zero_()
    tiles = triton.cdiv(n, cfg.block_n)
    block_m = 8 if m <= 8 else 16
    consts = dict(
        GROUP_SIZE=group_size, BLOCK_M=block_m, FP16=x.dtype == torch.float16,
        WARPS=cfg.warps, REP=cfg.rep, BLOCKS=cfg.blocks, EVEN_K=(k // 8) % (4 * cfg.blocks) == 0,
        EVEN_N=n % cfg.block_n == 0, SCALE_AFTER=cfg.scales_after_dot(group_size),
        num_warps=cfg.warps,
    )  # fmt: skip
    if cfg.max_regs:
        consts["maxnreg"] = cfg.max_regs
    args = [
        x, qweight, scales, zeros, out, None, None, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
    ]  # fmt: skip
    split = cfg.split_k
    if split == 0:  # as many programs as fit at once (one wave), work evened out

        def fit(split: int) -> tuple[int, int]:  # compiled once per split
            key = (x.device, split, *consts.values())
            if key not in _FIT:
                args[5:7] = _WORKSPACE.get(x.device, 1, 1)
                probe = _int4_mma_kernel.warmup(*args, grid=(1, 1), SPLIT_K=split, **consts)
                sms = torch.cuda.get_device_properties(x.device).multi_processor_count
                _FIT[key] = (programs_per_sm(probe, cfg.warps, x.device), sms)
            return _FIT[key]

        split = wave_split(cfg.steps(k), tiles, *fit(2), cfg.warps)
        if split > 2:  # the last split's sum of the partials takes a few more registers
            split = wave_split(cfg.steps(k), tiles, *fit(split), cfg.warps)
    # the partial sums of every split of every column tile, and a counter per column tile
    args[5:7] = _WORKSPACE.get(x.device, tiles * split * cfg.block_n * block_m, tiles)
    _int4_mma_kernel[(tiles, split)](*args, SPLIT_K=split, **consts)
    return out
