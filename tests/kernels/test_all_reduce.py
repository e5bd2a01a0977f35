"""The one-shot all-reduce kernel (kernels/all_reduce.py), one rank's call in one process: the
peers' rows are put in place first, as the peers would have written them over NVLink, so the
call runs to its end on one device (the interpreter on a CPU). The two-GPU run is
tests/engine/test_tp_gpu.py's and benchmarks/tp_decode_bench.py's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from llmfleet.kernels.all_reduce import (  # noqa: E402
    EMPTY,
    MAX_ROWS,
    ROW_BYTES,
    SLOTS,
    PeerAllReduce,
    all_reduce_ref,
    as_sent,
    fill_empty,
    launch,
)
from llmfleet.kernels.gemv import GemvConfig, gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT32_MAX = 2**31 - 1


class Buffers:
    """Every rank's data buffer in this process (what `PeerAllReduce` maps), seen as rank
    `rank`'s call would see them."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        cells = SLOTS * MAX_ROWS * world
        self.data = [
            fill_empty(torch.empty(cells * ROW_BYTES, dtype=torch.uint8, device=DEVICE))
            for _ in range(world)
        ]
        self.data_ptrs = torch.tensor([t.data_ptr() for t in self.data], device=DEVICE)
        self.seq = torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEVICE)

    def cell(self, number: int, row: int, source: int) -> int:
        return ((number & 1) * MAX_ROWS + row) * self.world + source

    def row(self, rank: int, number: int, row: int, source: int, hidden: int, dtype):
        """Rank `rank`'s buffer cell holding `source`'s row `row` of call `number`."""
        per_row = ROW_BYTES // dtype.itemsize
        start = self.cell(number, row, source) * per_row
        return self.data[rank].view(dtype)[start : start + hidden]

    def sent(self, number: int, r: int, hidden: int, dtype) -> list[torch.Tensor]:
        """Where this rank's row `r` of call `number` went: each peer's buffer."""
        peers = [p for p in range(self.world) if p != self.rank]
        return [self.row(p, number, r, self.rank, hidden, dtype) for p in peers]

    def peers_ready(self, number: int, parts: list[torch.Tensor]) -> None:
        """The peers have written their rows for call `number` into this rank's buffer."""
        for p, part in enumerate(parts):
            if p == self.rank:
                continue
            for r in range(part.shape[0]):
                self.row(self.rank, number, r, p, part.shape[1], part.dtype).copy_(as_sent(part[r]))

    def all_empty(self, rank: int, number: int, rows: int, hidden: int, dtype) -> bool:
        """Rank `rank`'s cells of call `number`'s slot for `rows` rows from its peers hold
        only the EMPTY pattern (read, and refilled)."""
        width = torch.int32 if dtype.itemsize == 4 else torch.int16
        empty = EMPTY[dtype.itemsize][0]
        return all(
            bool((self.row(rank, number, r, p, hidden, dtype).view(width) == empty).all())
            for r in range(rows)
            for p in range(self.world)
            if p != rank
        )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["sum", "norm", "residual"])
def test_a_rank_sums_its_peers_rows_and_sends_its_own(
    world: int, rank: int, dtype: torch.dtype, mode: str
) -> None:
    rows, hidden = 3, 96
    bufs = Buffers(rank, world)
    parts = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(world)]
    weight = torch.randn(hidden, device=DEVICE).to(dtype) if mode != "sum" else None
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype) if mode == "residual" else None
    bufs.peers_ready(1, parts)
    x = parts[rank].clone()
    got = launch(bufs, x, weight, 1e-6, residual)
    want = all_reduce_ref(parts, weight, 1e-6, residual)
    if mode == "sum":
        assert got is x  # in place
        assert torch.equal(got, want)  # the same additions in the same order
    else:
        assert torch.equal(got[1], want[1])  # the residual stream: every rank's bits alike
        assert rel_err(got[0], want[0]) < (1e-6 if dtype == torch.float32 else 1e-2)
    for r in range(rows):  # its row is in every peer's buffer
        for cell in bufs.sent(1, r, hidden, dtype):
            assert torch.equal(cell, parts[rank][r])
    assert bufs.all_empty(rank, 1, rows, hidden, dtype)  # the cells it read: empty again
    assert bufs.seq.tolist() == [1] * rows + [0] * (MAX_ROWS - rows)


def test_consecutive_calls_alternate_slots_and_a_wrapped_number_still_meets() -> None:
    rows, hidden, dtype = 2, 64, torch.float16
    bufs = Buffers(0, 2)
    bufs.seq.fill_(INT32_MAX - 1)
    for number in (INT32_MAX, -(2**31), -(2**31) + 1):  # odd, then wrapped even, odd
        parts = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(2)]
        bufs.peers_ready(number, parts)
        got = launch(bufs, parts[0].clone(), None, 1e-6, None)
        assert torch.equal(got, all_reduce_ref(parts))
        assert bufs.seq[0].item() == number
        assert torch.equal(bufs.sent(number, 1, hidden, dtype)[0], parts[0][1])
        assert bufs.all_empty(0, number, rows, hidden, dtype)


def test_a_peers_row_of_the_next_call_in_the_other_slot_is_left_alone() -> None:
    # A pushed call reads the peers' cells of both slots before it knows its number. A peer
    # that already has this rank's pushed row may have passed this call and written its row of
    # the next one into the other slot: the call sums its own slot's, and leaves that row for
    # the next call.
    rows, hidden, dtype = 1, 64, torch.bfloat16 if torch.cuda.is_available() else torch.float16
    bufs = Buffers(0, 2)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    for number in (1, 2):
        parts = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(2)]
        ahead = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(2)]
        bufs.peers_ready(number, parts)
        bufs.peers_ready(number + 1, ahead)  # the other slot
        residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
        normed, total = launch(bufs, parts[0].clone(), weight, 1e-6, residual, pushed=True)
        want_normed, want_total = all_reduce_ref(parts, weight, 1e-6, residual)
        assert torch.equal(total, want_total)
        assert rel_err(normed, want_normed) < 1e-2
        assert bufs.all_empty(0, number, rows, hidden, dtype)
        assert torch.equal(bufs.row(0, number + 1, 0, 1, hidden, dtype), as_sent(ahead[1][0]))
        fill_empty(bufs.data[0])  # (the next call's row, consumed as that call would)


def test_a_residual_needs_the_norm() -> None:
    bufs = Buffers(0, 2)
    x = torch.randn(1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        launch(bufs, x, None, 1e-6, torch.randn(1, 32, device=DEVICE))


# (bfloat16 on GPUs: the interpreter rounds float32 to bfloat16 by truncation)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available()
)
def test_values_of_the_empty_pattern_are_sent_as_their_stand_in(dtype: torch.dtype) -> None:
    # The EMPTY pattern marks a cell no row has reached yet; a row holding it (a 16-bit -0.0,
    # float32's denormal 0x80008000) is sent as the stand-in, and every rank sums that.
    rows, hidden = 2, 64
    width = torch.int32 if dtype.itemsize == 4 else torch.int16
    empty, standin = EMPTY[dtype.itemsize]
    bufs = Buffers(1, 2)
    parts = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(2)]
    for part in parts:
        part.view(width)[:, :5] = empty  # on both ranks: the sum would be EMPTY too
    bufs.peers_ready(1, parts)
    got = launch(bufs, parts[1].clone(), None, 1e-6, None)
    sent = bufs.sent(1, 0, hidden, dtype)[0].view(width)
    assert (sent[:5] == standin).all() and torch.equal(sent[5:], parts[1][0].view(width)[5:])
    assert torch.equal(got.view(width), all_reduce_ref(parts).view(width))  # bit for bit
    assert not (got.view(width) == empty).any()


def pushing_peer(bufs: Buffers) -> PeerAllReduce:
    """The group's host side (`PeerAllReduce`) over `bufs`, without the symmetric memory a
    real group maps (its methods read only these fields)."""
    peer = PeerAllReduce.__new__(PeerAllReduce)
    peer.rank, peer.world, peer.device = bufs.rank, bufs.world, bufs.seq.device  # (cuda:0)
    peer.data_ptrs, peer.seq, peer._pushed = bufs.data_ptrs, bufs.seq, None
    return peer


@pytest.mark.parametrize("world,rank", [(2, 0), (3, 2)])
@pytest.mark.parametrize("mode", ["sum", "residual"])
def test_a_gemv_pushes_its_row_and_the_call_only_waits_for_the_peers(
    world: int, rank: int, mode: str
) -> None:
    # A row-parallel projection's one row: the GEMV's programs write their slices into the
    # peers' cells of the next call (two calls in, so the other slot), the call sums as if it
    # had sent the row itself.
    hidden, k, dtype = 72, 48, torch.float16
    bufs = Buffers(rank, world)
    peer = pushing_peer(bufs)
    g = torch.Generator().manual_seed(world + rank)
    w = torch.randn(hidden, k, generator=g).to(DEVICE, dtype)
    w[3] = 0.0  # column 3 sums to -2^-34 (x[0] = 1, x[1] = 1 + 2^-10): -0.0, the EMPTY pattern
    w[3, 0], w[3, 1] = 2.0**-24, -(2.0**-24)
    weight = torch.randn(hidden, generator=g).to(DEVICE, dtype) if mode != "sum" else None
    residual = torch.randn(1, hidden, generator=g).to(DEVICE, dtype) if mode != "sum" else None
    for number in (1, 2):
        x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
        x[0, 0], x[0, 1] = 1.0, 1.0 + 2.0**-10
        out = torch.empty(1, hidden, dtype=dtype, device=DEVICE)
        assert peer.takes_push(out)
        gemv(x, w, config=GemvConfig(block_n=16, block_k=16), out=out, push=peer)
        peer.note_push(out)
        assert out.view(torch.int16)[0, 3] == EMPTY[2][0]  # a -0.0 left as computed here
        for cell in bufs.sent(number, 0, hidden, dtype):  # already in every peer's buffer
            assert torch.equal(cell, as_sent(out[0]))
        parts = [torch.randn(1, hidden, generator=g).to(DEVICE, dtype) for _ in range(world)]
        parts[rank] = out.clone()
        bufs.peers_ready(number, parts)
        got = peer(out, weight, 1e-6, residual)
        want = all_reduce_ref(parts, weight, 1e-6, residual)
        if mode == "sum":
            assert got is out and torch.equal(got, want)
        else:
            assert torch.equal(got[1], want[1])
            assert rel_err(got[0], want[0]) < 1e-2
        assert bufs.seq[0].item() == number
        assert bufs.all_empty(rank, number, 1, hidden, dtype)


def test_a_push_not_summed_next_breaks_the_group_loudly() -> None:
    bufs = Buffers(0, 2)
    peer = pushing_peer(bufs)
    x = torch.randn(1, 32, device=DEVICE).half()
    w = torch.randn(64, 32, device=DEVICE).half()
    out = torch.empty(1, 64, dtype=torch.float16, device=DEVICE)
    assert not peer.takes_push(torch.empty(2, 64, dtype=torch.float16, device=DEVICE))
    assert not peer.takes_push(torch.empty(1, 64, device=DEVICE))  # float32: not 16-bit
    gemv(x, w, out=out, push=peer)
    peer.note_push(out)
    with pytest.raises(RuntimeError, match="never summed"):
        peer.takes_push(out)
    other = out.clone()
    with pytest.raises(RuntimeError, match="not summed next"):
        peer(other)
    with pytest.raises(RuntimeError, match="out of step"):  # and every call after it
        peer(other)
    assert bufs.seq[0].item() == 0  # no call ran


def test_a_pushing_gemv_rejects_what_it_cannot_push() -> None:
    peer = pushing_peer(Buffers(0, 2))
    x = torch.randn(1, 32, device=DEVICE).half()
    with pytest.raises(ValueError, match="pushed GEMV"):
        gemv(x, torch.randn(64, 32, device=DEVICE).half(), gated=True, push=peer)
    with pytest.raises(ValueError, match="pushed GEMV"):
        gemv(x, torch.randn(64, 32, device=DEVICE).half(), out=torch.empty(1, 64), push=peer)
