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
    all_reduce_ref,
    as_sent,
    fill_empty,
    launch,
)

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
