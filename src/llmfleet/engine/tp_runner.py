"""Rank 0's runner in a tensor-parallel worker: a `ModelRunner` over rank 0's shard whose every
forward pass and KV block copy first has the follower ranks do the same (tp_step.py).

Sampling stays on rank 0, which alone runs the scheduler, the block manager and the sampler.

CUDA graphs: every rank captures its decode graphs at once (CAPTURE), each with the model's
collectives inside, and a pure-decode step that fits them is one DECODE op: every rank replays
its graph of the same padded size, so the collectives of the replays meet. Under async
scheduling the step's token ids are still on rank 0's device: they follow as a broadcast on
the stream, behind the step that samples them, from rank 0's graph input straight into the
followers' (`PaddedDecoder.run`'s `share`), and no rank waits for the host.

KV payloads hold every KV head in global order whatever the TP size: `read_blocks` gathers
the heads of all ranks (a head replicated on several ranks is taken once), `write_blocks`
broadcasts a payload and each rank writes its own heads. `block_shape` counts all the heads,
so the worker's KV layout (handoff, kvstore) is the model's, not the shard's: workers of
different TP sizes exchange KV as they are.
"""

from __future__ import annotations

import gc
import logging

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.cuda_graphs import PaddedDecoder
from llmfleet.engine.model_runner import BlockRead, ModelRunner, StepInputs
from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.engine.tp_ranks import Ranks
from llmfleet.engine.tp_step import (
    CAPTURE,
    DECODE,
    INIT,
    READ,
    STEP,
    WRITE,
    HeadMap,
    encode_decode,
    encode_step,
)
from llmfleet.models.loader import ModelSpec

logger = logging.getLogger(__name__)


class TPModelRunner(ModelRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        spec: ModelSpec,
        block_manager: BlockManager,
        ranks: Ranks,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.ranks = ranks
        ranks.send(INIT, [block_manager.num_blocks])  # the followers allocate as many blocks
        super().__init__(model, spec, block_manager, dtype=dtype, device=device)
        self.heads = HeadMap.exchange(spec, 0, ranks.tp.group, device)
        ranks.done()

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Every rank captures the same graphs (the followers' runners decide as this one)."""
        self.ranks.send(CAPTURE, [max_batch_size, max_model_len])
        super().capture_decode_graphs(max_batch_size, max_model_len)
        self.ranks.done()

    def _run_graphs(
        self,
        graphs: PaddedDecoder,
        token_ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        on_device = isinstance(token_ids, torch.Tensor)
        counts, body = encode_decode(positions, tables, None if on_device else list(token_ids))
        self.ranks.send(DECODE, counts, body)
        share = self.ranks.channel.broadcast if on_device else None
        logits = graphs.run(token_ids, positions, tables, share)
        self.ranks.done()
        return logits

    @torch.inference_mode()
    def run(self, batch: StepInputs, mm: SchedulerOutput | None = None) -> torch.Tensor:
        if mm is not None:  # (MultimodalInputs is disabled under tensor parallelism)
            raise ValueError("a tensor-parallel step carries no input embeddings")
        counts, body = encode_step(batch)
        self.ranks.send(STEP, counts, body)
        logits = super().run(batch)
        self.ranks.done()
        return logits

    @torch.inference_mode()
    def start_read(self, block_ids: list[int], *, to_host: bool = True) -> BlockRead:
        if not block_ids:
            return BlockRead(
                torch.empty((0, *self.block_shape), dtype=self.kv_caches[0].dtype), None
            )
        self.ranks.send(READ, [len(block_ids)], block_ids)
        read = super().start_read(block_ids, to_host=to_host)
        self.ranks.done()
        return read

    def _payload(self, block_ids: list[int]) -> torch.Tensor:
        """Every rank's heads of the blocks, gathered here: (nb, L, 2, bs, total, D)."""
        full = self.heads.gather(self.cache_blocks(block_ids), self.ranks.tp.group)
        if full is None:
            raise RuntimeError("the KV heads gather returned nothing on rank 0")
        return full

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Write a full-head payload (nb, L, 2, bs, total, D): each rank its own heads."""
        self.check_payload(block_ids, payload)
        if not block_ids:
            return
        self.ranks.send(WRITE, [len(block_ids)], block_ids)
        full = payload.to(self.device, self.kv_caches[0].dtype).contiguous()
        self.ranks.channel.broadcast(full)
        self.write_cache(block_ids, self.heads.local(full))
        self.ranks.done()

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's payload shape, all the model's KV heads: (L, 2, bs, total, D)."""
        L, two, bs, _, D = super().block_shape
        return (L, two, bs, self.heads.total, D)

    def close(self) -> None:
        """Stop the follower ranks (see `Ranks.close`). The graphs go first: NCCL does not
        tear a communicator down while captured collectives still hold it."""
        release_graphs(self)
        self.ranks.close()


def release_graphs(runner: ModelRunner) -> None:
    """Drop `runner`'s decode graphs and wait until the device has let go of them."""
    if runner.decode_graphs is None:
        return
    runner.decode_graphs = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
