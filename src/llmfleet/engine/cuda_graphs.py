"""CUDA graphs for pure-decode steps: captured once per batch size at start-up, replayed per step.

A decode step of a small model is mostly host work: a few hundred kernel launches of a few
microseconds of GPU time each. Replaying a captured graph issues all of them in one call.

Which steps replay: every scheduled sequence brings exactly one new token, there are at most
`max_batch_size` of them, and every block table fits `max_blocks_per_seq` (the context bound
`max_model_len`). Prefill, mixed and larger steps run eagerly.

Padding. A batch of n sequences replays the graph of the smallest captured size B >= n
(`capture_sizes`: 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ...). Rows n .. B-1 are padding:

    token id 0, position 0, slot -1      the KV write skips negative slots: no block is touched
    context length 1, block table [0]    attention reads slot 0 of block 0 (finite, read only)
    logits row                           dropped

Static buffers (`DecodeBuffers`; one pinned host copy, one device copy that the graphs read):

    i64 (3, max_B):  row 0 token ids | row 1 positions | row 2 slots       (row r[:B] contiguous)
    i32 flat:        [ seq_lens (max_B) | block_tables (max_B, max_blocks_per_seq) row-major ]

Both live in one byte buffer (i64 first). A step fills the host copy, copies in one piece i64
(from the first padding row's token id on when the tokens are already on the device) and the
i32 prefix that holds B table rows, and replays. Table columns past a sequence's last block
keep stale ids; the kernels never read them (a sequence of length L reads columns
< ceil(L / block_size)).

Graph-safe attention: inside a graph the host-side bounds the launchers size their grids with
cannot follow the batch, so the captured metadata carries the static bound `max_model_len` as
`max_seq_len` (split-K partitions past a sequence's length exit at once) and only the device
tensors change between replays. Only backends that declare `cuda_graph_safe` qualify.

Graphs of all sizes share one memory pool, captured largest first; each writes its logits into
one static (max_B, V) buffer allocated outside the pool, so no graph's output outlives the
pool's reuse by the next replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from llmfleet.models.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, then steps of 8 to 32, of 16 to 128, of 32
    beyond, and `max_batch_size` itself (so every batch up to it has a graph)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [1, 2, 4, *range(8, 33, 8), *range(48, 129, 16), *range(160, max_batch_size + 1, 32)]
    kept = [s for s in sizes if s <= max_batch_size]
    if kept[-1] != max_batch_size:
        kept.append(max_batch_size)
    return kept


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_seqs (sizes ascending); None when none is."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """One decode batch's inputs, padded (see the module docstring for layout and padding).

    Views of the first `b` rows (`token_ids(b)`, ...) are contiguous and alias the buffers, so
    a graph captured on them reads whatever the last `fill` / `copy_from` put there.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        n, w = max_batch_size, max_blocks_per_seq
        # One byte buffer, so that a step's inputs cross in one copy: i64 then i32.
        self.raw = torch.zeros(
            24 * n + 4 * (n + n * w), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        self.i64 = self.raw[: 24 * n].view(torch.int64).view(3, n)
        self.i32 = self.raw[24 * n :].view(torch.int32)
        self.i64[2].fill_(-1)
        self.i32[:n].fill_(1)
        self._tables = self.i32[n:].view(n, w)
        # The decode rows' query starts (0, 1, ..., n): fixed, so no graph computes them.
        self._starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        if self.i64.device.type == "cpu":  # numpy views: list -> buffer without torch overhead
            self._i64_np = self.i64.numpy()
            self._seq_np = self.i32[:n].numpy()
            self._tables_np = self._tables.numpy()
        # Per row: the block table `fill` last wrote there and how many of its entries. A
        # table passed again as the same list (the block manager's live lists only grow) gets
        # just its new entries written: a steady batch rewrites almost nothing.
        self._written: list[tuple[Sequence[int] | None, int]] = [(None, 0)] * n

    def token_ids(self, b: int) -> torch.Tensor:  # int64 (b,)
        return self.i64[0, :b]

    def positions(self, b: int) -> torch.Tensor:  # int64 (b,)
        return self.i64[1, :b]

    def slot_mapping(self, b: int) -> torch.Tensor:  # int64 (b,), -1 on padding rows
        return self.i64[2, :b]

    def seq_lens(self, b: int) -> torch.Tensor:  # int32 (b,)
        return self.i32[:b]

    def block_tables(self, b: int) -> torch.Tensor:  # int32 (b, max_blocks_per_seq)
        return self._tables[:b]

    def fits(self, positions: Sequence[int], block_tables: Sequence[Sequence[int]]) -> bool:
        """Whether these sequences fit the buffers (batch size, table width)."""
        if len(positions) > self.max_batch_size:
            return False
        return all(len(t) <= self.max_blocks_per_seq for t in block_tables)

    def fill(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        batch_size: int,
    ) -> None:
        """Host buffers only: sequence i decodes `token_ids[i]` at `positions[i]` over
        `block_tables[i]`; rows len(token_ids) .. batch_size - 1 become padding."""
        n, bs = len(token_ids), self.block_size
        if not n <= batch_size <= self.max_batch_size:
            raise ValueError(f"{n} sequences do not fit batch size {batch_size}")
        if not (len(positions) == len(block_tables) == n):
            raise ValueError("token_ids, positions and block_tables need one entry per sequence")
        i64, seq, tables = self._i64_np, self._seq_np, self._tables_np
        w, written = self.max_blocks_per_seq, self._written
        for i, (p, t) in enumerate(zip(positions, block_tables, strict=True)):
            m = len(t)
            if m > w or p >= m * bs or p < 0:
                raise ValueError(f"position {p} does not fit a block table of {m} blocks")
            src, done = written[i]
            if src is not t or done > m:
                done = 0
            if done < m:
                tables[i, done:m] = t[done:]
                written[i] = (t, m)
        i64[0, :n] = token_ids
        i64[1, :n] = positions
        pos = i64[1, :n]
        i64[2, :n] = tables[np.arange(n), pos // bs] * bs + pos % bs  # slots
        i64[:2, n:batch_size] = 0
        i64[2, n:batch_size] = -1
        seq[:n] = pos + 1
        seq[n:batch_size] = 1
        tables[n:batch_size, 0] = 0
        written[n:batch_size] = [(None, 0)] * (batch_size - n)

    def copy_from(self, host: DecodeBuffers, batch_size: int, *, keep_ids: int = 0) -> None:
        """Device buffers: take the first `batch_size` rows of `host` (asynchronously, one
        copy), except the first `keep_ids` token ids (they come from the device)."""
        start = self.i64.element_size() * keep_ids  # (row 0 of i64 is the token ids)
        end = self.i64.nbytes + self.i32[: self.max_batch_size].nbytes
        end += self._tables[:batch_size].nbytes
        self.raw[start:end].copy_(host.raw[start:end], non_blocking=True)

    def metadata(self, b: int, max_seq_len: int) -> AttentionMetadata:
        """Decode metadata over the first `b` rows; host-side lengths are the static bound
        `max_seq_len` (the true lengths live only on the device, see the module docstring)."""
        return AttentionMetadata(
            num_seqs=b,
            num_tokens=b,
            query_start_loc=self._starts[: b + 1],
            seq_lens=self.seq_lens(b),
            block_tables=self.block_tables(b),
            slot_mapping=self.slot_mapping(b),
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[max_seq_len] * b,
        )


class PaddedDecoder:
    """Decode steps of one model over one set of KV caches, padded to the captured sizes and
    read from static buffers, run eagerly. `DecodeGraphs` captures exactly this; on its own it
    runs the same padded path anywhere (a CPU test drives it under Triton's interpreter).

    Owns the static buffers; `run` is the only thing that writes them. One thread uses an
    instance (the engine's), and the logits `run` returns stay valid until its next call.
    On CUDA the host rows cross on a side stream, after the previous step has read the
    buffers; the caller's stream waits for them before the step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        max_batch_size: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        backend = getattr(model, "backend", None)
        if not getattr(backend, "cuda_graph_safe", False):
            name = getattr(backend, "name", type(backend).__name__)
            raise ValueError(f"attention backend {name!r} cannot run inside a CUDA graph")
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch_size)
        block_size = kv_caches[0].shape[2]
        width = -(-max_model_len // block_size)
        args = (max_batch_size, width, block_size)
        on_cuda = self.device.type == "cuda"
        self.host = DecodeBuffers(*args, pin_memory=on_cuda)
        self.static = DecodeBuffers(*args, device=self.device)
        self.logits = torch.zeros(
            (max_batch_size, vocab_size), dtype=torch.float32, device=self.device
        )
        self.num_replays = 0  # decode steps run through `run`
        # Host buffers may be refilled once the previous step's copies have passed this.
        self._copied = torch.cuda.Event() if on_cuda else None
        # The copies run on a side stream once the last step has read the static buffers
        # (`_replayed`), so they overlap that step's end (its output head, the sampling)
        # instead of following it on the compute stream.
        self._side = torch.cuda.Stream(self.device) if on_cuda else None
        self._replayed = torch.cuda.Event() if on_cuda else None

    def _forward(self, b: int) -> None:
        meta = self.static.metadata(b, self.max_model_len)
        hidden = self.model(
            self.static.token_ids(b), self.static.positions(b), self.kv_caches, meta
        )
        self.model.compute_logits(hidden, out=self.logits[:b])

    def _launch(self, b: int) -> None:
        self._forward(b)

    def fits(self, positions: Sequence[int], block_tables: Sequence[Sequence[int]]) -> bool:
        """Whether a decode step of these sequences fits the padded sizes and buffers."""
        return (
            bool(positions)
            and self.static.fits(positions, block_tables)
            and max(positions) < self.max_model_len
        )

    def _stage(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        b: int,
        *,
        keep_ids: int = 0,
    ) -> None:
        if self._copied is not None:  # the host buffers' previous copy has run
            self._copied.synchronize()
        self.host.fill(token_ids, positions, block_tables, b)
        if self._side is None:  # (CPU)
            self.static.copy_from(self.host, b, keep_ids=keep_ids)
            return
        self._side.wait_event(self._replayed)
        with torch.cuda.stream(self._side):
            self.static.copy_from(self.host, b, keep_ids=keep_ids)
            self._copied.record()
        torch.cuda.current_stream(self.device).wait_stream(self._side)

    def run(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        share: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:  # (n, V) float32, a view of the static logits
        """One decode step (the caller checked `fits`): fill, copy, launch.

        `token_ids` may be an int64 tensor on the device (the previous step's samples, not
        read back yet): it is copied into the static buffer on the stream, after the host
        rows, so the step can be launched before those tokens are known on the host; the
        static buffer's own view (`static.token_ids(n)`) is used in place. `share` is then
        called with the static view before the launch (tensor parallelism: rank 0's tokens
        broadcast into the followers' views, which `share` fills)."""
        n = len(token_ids)
        b = padded_size(n, self.sizes)
        if b is None:
            raise ValueError(f"no padded size for a batch of {n}")
        on_device = isinstance(token_ids, torch.Tensor)
        ids = [0] * n if on_device else token_ids
        self._stage(ids, positions, block_tables, b, keep_ids=n if on_device else 0)
        if on_device:
            view = self.static.token_ids(n)
            if token_ids.data_ptr() != view.data_ptr():
                view.copy_(token_ids)
            if share is not None:
                share(view)
        self._launch(b)
        if self._replayed is not None:  # the next step's copies may follow
            self._replayed.record()
        self.num_replays += 1
        return self.logits[:n]


class DecodeGraphs(PaddedDecoder):
    """`PaddedDecoder` whose steps replay CUDA graphs captured by `capture`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared pool. Padding-only inputs: no
        KV is written, so capturing leaves the cache as it was."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._stage([], [], [], b)
            self._forward(b)  # eager warm-up: compiles kernels, loads modules, picks algorithms
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
            self.sizes,
            time.perf_counter() - start,
            used / 2**20,
        )

    def _launch(self, b: int) -> None:
        self.graphs[b].replay()
