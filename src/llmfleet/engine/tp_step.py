"""The wire between a tensor-parallel worker's ranks: rank 0 (the engine) tells the follower
ranks which op to run next, in the order it runs them, and every rank then runs that op (the
model's collectives need them all).

Each op is a broadcast from rank 0 of a fixed int64 header, then (`BODY_OPS`) of one int64
body holding the header's counts of ints (on the host under NCCL: `StepChannel`):

    header (HEADER_LEN,):  [op, n0, n1, n2, n3, 0, 0, 0]

    SIZE      n0 = the KV blocks rank 0's memory holds      no body; once, first: every rank
                                 then joins an all-reduce MIN of its own count (`min_over`)
    INIT      n0 = num_blocks (the KV cache's size)         no body; once, after SIZE
    STEP      n0..n3 = num_tokens, num_seqs, num_table_ids, num_sample_tokens
              body: input_ids (n0) | positions (n0) | query_lens (n1) | seq_lens (n1)
                    | table_lens (n1) | block tables, concatenated (n2) | sample_tokens (n3)
    READ      n0 = num_blocks    body: block ids; then the KV heads gather (`HeadMap.gather`)
    WRITE     n0 = num_blocks    body: block ids; then a broadcast of the full-head payload
                                 (nb, L, 2, block_size, total_kv_heads, head_dim), cache dtype
    CAPTURE   n0, n1 = max_batch_size, max_model_len        no body; every rank captures its
                                 decode graphs (cuda_graphs.py), same sizes, same order
    DECODE    n0 = num_seqs, n1 = num_table_ids, n2 = 1 when the token ids follow as a
              broadcast of rank 0's device tensor (async scheduling: not on the host yet)
              body: positions (n0) | table_lens (n0) | block tables (n1) | token_ids (n0,
                    only when n2 = 0); every rank replays its graph of the same padded size
    SHUTDOWN                     no body: the followers leave their loop, then the group

Plain tensors, no pickling: on each rank's CUDA device under NCCL, on the CPU under gloo.

KV heads: rank r holds the global heads [starts[r], starts[r] + counts[r]) (a head may sit on
several ranks when there are fewer heads than ranks). A payload on the wire and in the engine
always has all `total` heads in global order, so its layout does not depend on the TP size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmfleet.engine.model_runner import StepInputs
from llmfleet.models.loader import ModelSpec

HEADER_LEN = 8
SHUTDOWN, INIT, STEP, READ, WRITE, CAPTURE, DECODE, SIZE = range(8)
BODY_OPS = (STEP, READ, WRITE, DECODE)


class StepChannel:
    """Broadcasts from rank 0; rank 0 sends, the other ranks receive.

    The ops (headers and bodies) travel over `host_group`, a gloo group of CPU tensors, when
    the ranks' `group` is NCCL: rank 0 sends an op as its host schedules it, without waiting
    for its device (a device tensor built from a host list waits for the stream), and a
    follower has it, stages its inputs and launches its step while the GPUs still run the
    previous one. Payloads (`broadcast`: a WRITE's KV, a DECODE's device token ids) stay on
    `group`, in the same order on every rank. Without `host_group` (gloo ranks) everything is
    on `group`."""

    def __init__(self, group: Any, device: torch.device, host_group: Any = None) -> None:
        self.group = group
        self.device = device
        self.host_group = group if host_group is None else host_group
        self.host_device = device if host_group is None else torch.device("cpu")

    def send(self, op: int, counts: list[int], body: list[int] | None = None) -> None:
        header = [op, *counts, *[0] * (HEADER_LEN - 1 - len(counts))]
        self._send_ints(header)
        if op in BODY_OPS:
            self._send_ints(body or [])

    def recv(self) -> tuple[int, list[int], list[int]]:
        """The next op: (op, its counts, its body)."""
        op, *counts = self._recv_ints(HEADER_LEN)
        if op not in BODY_OPS:
            return op, counts, []
        n_tok, n_seq, n_table, n_sample = counts[:4]  # READ, WRITE: n_tok is the block count
        if op == STEP:
            size = 2 * n_tok + 3 * n_seq + n_table + n_sample
        elif op == DECODE:  # n_tok, n_seq, n_table: num_seqs, num_table_ids, ids on device
            size = 2 * n_tok + n_seq + (0 if n_table else n_tok)
        else:
            size = n_tok
        return op, counts, self._recv_ints(size)

    def _send_ints(self, values: list[int]) -> None:
        t = torch.tensor(values, dtype=torch.int64, device=self.host_device)
        dist.broadcast(t, src=0, group=self.host_group)

    def _recv_ints(self, n: int) -> list[int]:
        t = torch.empty(n, dtype=torch.int64, device=self.host_device)
        dist.broadcast(t, src=0, group=self.host_group)
        return t.tolist()

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's device tensor `t` into every rank's `t` (a payload, on `group`)."""
        dist.broadcast(t, src=0, group=self.group)

    def min_over(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective: all ranks call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def encode_step(batch: StepInputs) -> tuple[list[int], list[int]]:
    """A STEP's counts and body (see the module docstring)."""
    tables = batch.block_tables
    counts = [
        len(batch.input_ids),
        len(batch.query_lens),
        sum(len(t) for t in tables),
        len(batch.sample_tokens),
    ]
    body = [
        *batch.input_ids,
        *batch.positions,
        *batch.query_lens,
        *batch.seq_lens,
        *(len(t) for t in tables),
        *itertools.chain.from_iterable(tables),
        *batch.sample_tokens,
    ]
    return counts, body


def decode_step(counts: list[int], body: list[int]) -> StepInputs:
    """The inverse of `encode_step`."""
    n_tok, n_seq, _, n_sample = counts[:4]
    parts = []
    at = 0
    for n in (n_tok, n_tok, n_seq, n_seq, n_seq):
        parts.append(body[at : at + n])
        at += n
    ids, positions, query_lens, seq_lens, table_lens = parts
    tables = []
    for n in table_lens:
        tables.append(body[at : at + n])
        at += n
    return StepInputs(ids, positions, query_lens, seq_lens, tables, body[at : at + n_sample])


@dataclass
class DecodeInputs:
    """A DECODE op: sequence i decodes token_ids[i] (None: a device broadcast follows) at
    positions[i] over block_tables[i]."""

    positions: list[int]
    block_tables: list[list[int]]
    token_ids: list[int] | None


def encode_decode(
    positions: list[int], block_tables: list[list[int]], token_ids: list[int] | None
) -> tuple[list[int], list[int]]:
    """A DECODE's counts and body (see the module docstring)."""
    n_table = sum(len(t) for t in block_tables)
    counts = [len(positions), n_table, int(token_ids is None)]
    body = [*positions, *(len(t) for t in block_tables)]
    body += itertools.chain.from_iterable(block_tables)
    body += token_ids or []
    return counts, body


def decode_decode(counts: list[int], body: list[int]) -> DecodeInputs:
    """The inverse of `encode_decode`."""
    n, n_table, on_device = counts[:3]
    positions, lens, at = body[:n], body[n : 2 * n], 2 * n
    tables = []
    for m in lens:
        tables.append(body[at : at + m])
        at += m
    return DecodeInputs(positions, tables, None if on_device else body[at : at + n])


@dataclass(frozen=True)
class HeadMap:
    """Which global KV heads each rank's cache holds (see the module docstring)."""

    rank: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    total: int

    @classmethod
    def exchange(cls, spec: ModelSpec, rank: int, group: Any, device: torch.device) -> HeadMap:
        """Every rank's heads, from every rank's spec (a collective: all ranks call it)."""
        total = getattr(spec, "total_num_kv_heads", 0) or spec.num_kv_heads
        start = getattr(spec, "kv_head_start", 0)
        mine = torch.tensor([start, spec.num_kv_heads, total], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        rows = [t.tolist() for t in every]
        if len({r[2] for r in rows}) != 1:
            raise RuntimeError(f"ranks disagree on the number of KV heads: {rows}")
        covered = {h for s, n, _ in rows for h in range(s, s + n)}
        if covered != set(range(total)):
            raise RuntimeError(f"the ranks' KV heads {rows} do not cover all {total}")
        return cls(rank, tuple(r[0] for r in rows), tuple(r[1] for r in rows), total)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a full-head payload (nb, L, 2, bs, total, D): a view."""
        return full.narrow(4, self.starts[self.rank], self.counts[self.rank])

    def gather(self, local: torch.Tensor, group: Any) -> torch.Tensor | None:
        """The full-head payload on rank 0 (None elsewhere) from every rank's `local`
        (nb, L, 2, bs, counts[rank], D): a collective, all ranks call it."""
        width = max(self.counts)
        shape = (*local.shape[:4], width, local.shape[5])
        if local.shape[4] == width:
            padded = local.contiguous()
        else:  # uneven splits: every rank sends `width` heads, the padding is dropped
            padded = local.new_zeros(shape)
            padded[:, :, :, :, : local.shape[4]] = local
        if self.rank != 0:
            dist.gather(padded, None, dst=0, group=group)
            return None
        parts = [torch.empty_like(padded) for _ in self.counts]
        dist.gather(padded, parts, dst=0, group=group)
        return torch.cat(parts, dim=4).index_select(4, self._order(padded.device))

    def _order(self, device: torch.device) -> torch.Tensor:
        """Index of each global head in the concatenated padded parts: its first holder's."""
        width = max(self.counts)
        order = []
        for head in range(self.total):
            r = next(
                r
                for r, (s, n) in enumerate(zip(self.starts, self.counts, strict=True))
                if s <= head < s + n
            )
            order.append(r * width + head - self.starts[r])
        return torch.tensor(order, dtype=torch.long, device=device)
