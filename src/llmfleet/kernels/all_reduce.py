"""One-shot all-reduce of a few rows over the GPUs of one host, optionally fused with the
residual add and RMSNorm that follow a row-parallel projection in a decoder layer.

    all_reduce(x)                      -> sum over ranks of x                      (in place)
    all_reduce(x, weight, eps)         -> (rms_norm(s, w), s),   s = sum of x
    all_reduce(x, weight, eps, r)      -> (rms_norm(s, w), s),   s = sum of x + r

A batch-1 decode step at TP=2 makes 64 all-reduces of 8 KiB on a Llama-3-8B shape. NCCL takes
about 10 us for each, and the add + norm after it is another launch. Here every rank's GPU writes
its row straight into its peers' memory over NVLink, in the same kernel that adds and
normalizes, so each all-reduce is one short kernel.

Memory (torch symmetric memory: every rank maps every other rank's buffers):

    data (per rank): cells [slot][row][source rank] of ROW_BYTES: the sources' rows, or EMPTY
    seq  (local):    int32 [row], the calls row `row` has taken part in

No flags: a cell's values are their own signal. Every cell starts filled with the EMPTY bit
pattern (0x8000 in each 16-bit half: -0.0 of a 16-bit float; a negative denormal of float32),
which no row carries: a sender replaces that pattern in its values by the zero of the same sign
class (a 16-bit -0.0 becomes +0.0, float32's denormal -2^-135 becomes -0.0; the sum every rank
computes uses the replaced values, so all ranks still agree bit for bit).

Program `row` of a call: seq[row] += 1 (the new value is the call's number, its parity the
slot); write this rank's row into cell [slot][row][me] of every peer's buffer (plain stores,
no fence: nothing else has to land before it); for every peer p, read its own cell
[slot][row][p] until no value is EMPTY (volatile loads: each value is written once, so a
value that is not EMPTY is the peer's), then fill that cell with EMPTY again; sum the rows in
rank order (every rank adds the same values in the same order, so all get the same bits);
add, normalize, store. One NVLink crossing per row, and no release fence, whose round trip
(the peer acknowledging the row before the flag may follow) a flag protocol pays.

A pushed call: a one-row projection whose result is this rank's part of the next call's sum
(a row-parallel GEMV, kernels/gemv.py) writes it into the peers' cells itself, each program its
slice as it finishes (`push_slice`: the cell of call seq[0] + 1, as the call will number
itself). The call then runs with PUSHED: it numbers itself and waits for the peers' rows but
sends nothing, so the row's crossing overlaps the end of the projection and this kernel's
launch. `PeerAllReduce.note_push` records the pushed tensor: the next call must sum exactly it
(anything else leaves a row in the peers' cells that no call expects, so the all-reduce refuses
every later call).

Why two slots are enough: a peer rewrites a slot-s cell only at the call after next on that
row, and to get there it must pass the next call on that row, which needs this rank's row of
that call, which this rank sends only after the current call has ended (stream order; under PDL
no program touches memory before the kernel before it has ended, except to read what no kernel
writes: a GEMV its weight, this kernel its buffer's address and a parameter's norm weight), and
with it the refill of the cell. Every rank runs the same calls
with the same row counts (tensor parallelism requires it), so the per-row numbers agree across
ranks whether a call is eager or inside a CUDA graph; equality with a wrapping int32 needs no
reset. A rank that stops answering leaves its peers waiting, as NCCL does; NCCL's watchdog on
the step's next collective (the logits' gather) ends the process.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmfleet.kernels.rms_norm import rms_norm_ref
from llmfleet.kernels.triton_utils import check_last_dim_contiguous, launchable, pdl

MAX_ROWS = 64  # rows a call may have
ROW_BYTES = 32 << 10  # bytes a row may have: hidden 8192 in float32, 16384 in 16 bits
# Bytes a call may have: 64 rows of Llama-3-8B's bf16 hidden state, as far as it was measured
# (2x H200, hidden 4096: 2.08x NCCL + the norm's kernel at 1 row, 2.00x at 64); larger sums go
# to NCCL.
MAX_BYTES = 512 << 10
SLOTS = 2
EMPTY16 = -(1 << 15)  # 0x8000: a cell's 16-bit values before a row lands (-0.0)
# Per width: (the EMPTY pattern, what a sender writes instead of a value with that pattern)
EMPTY = {2: (EMPTY16, 0), 4: (-(1 << 31) + (1 << 15), -(1 << 31))}  # 0x80008000 -> 0x80000000


def fill_empty(data: torch.Tensor) -> torch.Tensor:
    """Fill a data buffer (uint8, an even number of bytes) with the EMPTY pattern."""
    return data.view(torch.int16).fill_(EMPTY16)


@triton.jit
def _bits(v, WIDE: tl.constexpr):
    """v's bit pattern as integers of its width (int32 for float32, else int16)."""
    if WIDE:
        bits = v.to(tl.int32, bitcast=True)
    else:
        bits = v.to(tl.int16, bitcast=True)
    return bits


@triton.jit
def _as_sent(v, WIDE: tl.constexpr, EMPTY: tl.constexpr, STANDIN: tl.constexpr):
    """v's bits as a sender writes them: never the EMPTY pattern (its stand-in instead)."""
    bits = _bits(v, WIDE)
    return tl.where(bits == EMPTY, STANDIN, bits).to(bits.dtype)


@triton.jit
def _cell(seq, row, MAX_ROWS: tl.constexpr):
    """The (slot, row) cell index of call number `seq` on `row` (& keeps a wrapped number's
    parity)."""
    return (seq & 1) * MAX_ROWS + row


@triton.jit
def _send(bits, cols, mask, cell, data_ptrs, RANK: tl.constexpr, WORLD: tl.constexpr,
          ROW_ELEMS: tl.constexpr):  # fmt: skip
    """Store `bits` at columns `cols` of this rank's place in `cell` of every peer's buffer."""
    for p in tl.static_range(WORLD):
        if p != RANK:
            theirs = tl.load(data_ptrs + p).to(tl.pointer_type(bits.dtype))
            tl.store(theirs + (cell * WORLD + RANK) * ROW_ELEMS + cols, bits, mask=mask)


@triton.jit
def push_slice(
    values,  # (BLOCK,) 16-bit: columns `cols` of this rank's row 0, as the GEMV stores them
    cols,
    mask,
    data_ptrs,  # int64 (WORLD,): every rank's data buffer
    call,  # the number of the call that will sum this row: seq[0] + 1 (`next_call`)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    EMPTY: tl.constexpr,
    STANDIN: tl.constexpr,
):
    """A one-row projection's epilogue (kernels/gemv.py): send these columns of its result to
    the peers as the next all-reduce call on row 0 will (the call then runs with PUSHED and
    only waits for theirs)."""
    bits = _as_sent(values, False, EMPTY, STANDIN)
    _send(bits, cols, mask, _cell(call, 0, MAX_ROWS), data_ptrs, RANK, WORLD, ROW_ELEMS)


@triton.jit
def next_call(seq_ptr):
    """The number the next all-reduce call on row 0 will take: seq[0] + 1. A pushing GEMV
    reads it after its PDL wait (the previous call on row 0 has ended, and the call that
    takes the number has not started: stream order), at its start, so that the load's
    round trip does not delay its push."""
    return tl.load(seq_ptr) + 1


@triton.jit
def _all_reduce_kernel(
    x_ptr,  # (rows, H) this rank's addend, unit stride in H
    stride_x,  # elements between rows of x
    data_ptrs,  # int64 (WORLD,): every rank's data buffer, as mapped in this process
    seq_ptr,  # int32 (MAX_ROWS,): this rank's call numbers per row
    res_ptr,  # (rows, H) residual, read when HAS_RESIDUAL
    stride_res,  # elements between rows of the residual
    w_ptr,  # (H,) norm weight, read when NORM
    out_ptr,  # (rows, H): the sum (not NORM; may be x) or the normalized sum, contiguous
    sum_ptr,  # (rows, H) contiguous: the sum (+ residual), written when NORM
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    H: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= H: one row lives in registers
    ROW_ELEMS: tl.constexpr,  # elements between rows of a slot (ROW_BYTES / element size)
    MAX_ROWS: tl.constexpr,
    WIDE: tl.constexpr,  # float32 rows (32-bit values), else 16-bit
    EMPTY: tl.constexpr,  # the EMPTY pattern as a value of the rows' integer width
    STANDIN: tl.constexpr,  # what a sender writes for a value of the EMPTY pattern
    HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    PUSHED: tl.constexpr,  # x's one row is already in the peers' buffers (push_slice)
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    EARLY: tl.constexpr,  # NORM: w is not written in this kernel chain: read it before the wait
):
    # Every load that does not wait on another is issued at once, so the call costs about one
    # round trip to memory after the kernel before it ends: x, the row's call number, the
    # residual, and in a pushed call the peers' cells of both slots, read before the number is
    # known (it then picks one; the other may hold a peer's row of the next call, which is not
    # used; an unpushed call sends its row first, so its first read is after the send). This
    # rank's buffer address (written when the group was made) and a parameter's norm weight
    # come before the wait.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    if PDL:
        gdc_launch_dependents()
    my_buffer = tl.load(data_ptrs + RANK)  # (an address)
    if NORM and EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    if NORM and not EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    seq = tl.load(seq_ptr + row) + 1
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row.to(tl.int64) * stride_res + cols, mask=mask, other=0.0)
    bits = _as_sent(x, WIDE, EMPTY, STANDIN)
    mine = my_buffer.to(tl.pointer_type(bits.dtype))
    tl.debug_barrier()  # every thread has read the old number before it is replaced
    tl.store(seq_ptr + row, seq)
    cell = _cell(seq, row, MAX_ROWS)
    if not PUSHED:  # else the GEMV that computed x has written it to the peers (push_slice)
        _send(bits, cols, mask, cell, data_ptrs, RANK, WORLD, ROW_ELEMS)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += bits.to(dtype, bitcast=True).to(tl.float32)
        else:  # the peer's row as it lands in this rank's memory (volatile: past a stale L1)
            at = mine + (cell * WORLD + p) * ROW_ELEMS + cols
            if PUSHED:  # both slots, read before the number is known
                even = mine + (row * WORLD + p) * ROW_ELEMS + cols  # its cell in slot 0
                v0 = tl.load(even, mask=mask, other=0, volatile=True)
                v1 = tl.load(even + MAX_ROWS * WORLD * ROW_ELEMS, mask=mask, other=0, volatile=True)
                v = tl.where((seq & 1) == 1, v1, v0)
            else:  # the row is sent just above: it is rarely back at the first read
                v = tl.load(at, mask=mask, other=0, volatile=True)
            while tl.max((v == EMPTY).to(tl.int32), axis=0) > 0:
                v = tl.load(at, mask=mask, other=0, volatile=True)
            tl.store(at, tl.full((BLOCK,), EMPTY, v.dtype), mask=mask)  # for its next use
            acc += v.to(dtype, bitcast=True).to(tl.float32)
    s = acc.to(dtype)  # the sum as NCCL would return it
    if HAS_RESIDUAL:
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
    out_row = out_ptr + row.to(tl.int64) * H + cols
    if NORM:
        tl.store(sum_ptr + row.to(tl.int64) * H + cols, s, mask=mask)
        v = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
        tl.store(out_row, (v * rstd * w).to(dtype), mask=mask)
    else:
        tl.store(out_row, s, mask=mask)


BROKEN = torch.empty(0)  # PeerAllReduce._pushed after a push that was not summed next


class PeerAllReduce:
    """The one-shot all-reduce of one process group whose ranks are GPUs of this host (every
    rank builds one, collectively). `fits` says which tensors it takes; others go to NCCL."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        group = group if group is not None else dist.group.WORLD
        # (slot, row, source) cells of ROW_BYTES
        cells = SLOTS * MAX_ROWS * self.world
        self._data = fill_empty(symm_mem.empty(cells * ROW_BYTES, dtype=torch.uint8, device=device))
        self._handle = symm_mem.rendezvous(self._data, group)
        self.data_ptrs = torch.tensor(self._handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.seq = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
        # The row a GEMV pushed and the next call must sum (`note_push`); BROKEN after a
        # push was not followed by its sum: the peers' cells may hold a row no call expects,
        # so every later use fails loudly instead of summing the wrong rows.
        self._pushed: torch.Tensor | None = None
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's cells are EMPTY before anyone writes

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` (rows, hidden) is one this all-reduce takes: on this GPU, contiguous,
        at most MAX_ROWS rows of at most ROW_BYTES and MAX_BYTES in all."""
        return (
            x.device == self.device
            and x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] * x.element_size() <= ROW_BYTES
            and x.numel() * x.element_size() <= MAX_BYTES
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and x.is_contiguous()
        )

    def __call__(
        self,
        x: torch.Tensor,  # (rows, H) this rank's addend
        weight: torch.Tensor | None = None,  # (H,): normalize the sum
        eps: float = 1e-6,
        residual: torch.Tensor | None = None,  # (rows, H): added to the sum first
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The sum over the group (written into `x`), or with `weight` (normed, sum). Where
        `x` is the row a GEMV pushed (`note_push`), the call only waits for the peers' rows."""
        if not self.fits(x):
            raise ValueError(f"{tuple(x.shape)} {x.dtype} on {x.device} is not for this all-reduce")
        pushed = self._pushed is not None
        if pushed and x is not self._pushed:
            self._pushed = BROKEN
            raise RuntimeError(
                "a pushed row was not summed next: the group's cells are out of step"
            )
        self._pushed = None
        return launch(self, x, weight, eps, residual, pushed)

    def takes_push(self, out: torch.Tensor) -> bool:
        """Whether a one-row 16-bit projection may write its result `out` (1, H) into the
        peers' buffers as it computes it (`push_slice`), the next call here summing `out`."""
        if self._pushed is not None:
            raise RuntimeError("the previous pushed row was never summed: cells out of step")
        return out.shape[0] == 1 and out.element_size() == 2 and self.fits(out)

    def note_push(self, out: torch.Tensor) -> None:
        """`out` was pushed (its kernel is launched): the next call must sum exactly it."""
        self._pushed = out


class PeerState(Protocol):
    """What a launch reads: the group's buffers as this process maps them."""

    rank: int
    world: int
    data_ptrs: torch.Tensor  # int64 (world,)
    seq: torch.Tensor  # int32 (MAX_ROWS,)


def launch(
    peer: PeerState,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    pushed: bool = False,  # x (one row) is in the peers' buffers already (`push_slice`)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    if pushed and rows != 1:
        raise ValueError(f"a pushed call has one row, got {rows}")
    if residual is not None and (weight is None or residual.shape != x.shape):
        raise ValueError("a residual is added only with a norm weight, and matches x")
    if weight is not None and weight.shape != (hidden,):
        raise ValueError(f"weight must be ({hidden},), got {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None:
            check_last_dim_contiguous(name, t)
    norm = weight is not None
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if norm else x
    total = torch.empty_like(out) if norm else out
    block = triton.next_power_of_2(hidden)
    empty, standin = EMPTY[x.element_size()]
    chained = pdl(x.device)
    launchable(_all_reduce_kernel)[(rows,)](
        x, x.stride(0), peer.data_ptrs, peer.seq,
        residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0,
        weight if norm else x, out, total, eps,
        RANK=peer.rank, WORLD=peer.world, H=hidden, BLOCK=block,
        ROW_ELEMS=ROW_BYTES // x.element_size(), MAX_ROWS=MAX_ROWS,
        WIDE=x.element_size() == 4, EMPTY=empty, STANDIN=standin,
        HAS_RESIDUAL=residual is not None, NORM=norm, PUSHED=pushed, PDL=chained,
        EARLY=isinstance(weight, torch.nn.Parameter),
        num_warps=min(max(block // 256, 1), 16), launch_pdl=chained,
    )  # fmt: skip
    return (out, total) if norm else out


def as_sent(x: torch.Tensor) -> torch.Tensor:
    """x as a sender writes it into a peer's cell: values of the EMPTY pattern replaced."""
    empty, standin = EMPTY[x.element_size()]
    bits = x.view(torch.int32 if x.element_size() == 4 else torch.int16)
    return torch.where(bits == empty, standin, bits).to(bits.dtype).view(x.dtype)


def all_reduce_ref(
    parts: list[torch.Tensor],  # every rank's (rows, H), in rank order
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: the kernel's result from every rank's rows (as sent, added in rank
    order)."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += as_sent(p).float()
    s = acc.to(parts[0].dtype)
    if weight is None:
        return s
    if residual is None:
        return rms_norm_ref(s, weight, eps), s  # type: ignore[return-value]
    return rms_norm_ref(s, weight, eps, residual)
