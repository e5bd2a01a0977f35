"""A follower rank of a tensor-parallel worker: `python -m llmfleet.engine.tp_follower`, started
by rank 0 (tp_ranks.py), never by hand.

It joins the group, loads its shard of the model, allocates its KV cache (INIT: as many blocks
as rank 0's) and then runs every op rank 0 sends (tp_step.py) until SHUTDOWN: the same forward
pass with the same attention metadata (the logits are rank 0's to sample), its heads of a KV
read or write. It exits 0 on SHUTDOWN and non-zero when an op fails, rank 0's connection
closes or rank 0's process is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.forward_pass import load_shard
from llmfleet.engine.model_runner import ModelRunner
from llmfleet.engine.tp_ranks import GROUP_TIMEOUT, join_group, rank_device
from llmfleet.engine.tp_runner import release_graphs
from llmfleet.engine.tp_step import (
    CAPTURE,
    DECODE,
    INIT,
    READ,
    SHUTDOWN,
    STEP,
    WRITE,
    DecodeInputs,
    HeadMap,
    StepChannel,
    decode_decode,
    decode_step,
)
from llmfleet.shared.core.config import EngineConfig

logger = logging.getLogger(__name__)


@torch.inference_mode()
def follow(runner: ModelRunner, channel: StepChannel, heads: HeadMap) -> None:
    """Run rank 0's ops on this rank until SHUTDOWN."""
    while True:
        op, counts, body = channel.recv()
        if op == SHUTDOWN:
            return
        if op == STEP:
            runner.run(decode_step(counts, body))
        elif op == READ:
            heads.gather(runner.cache_blocks(body), channel.group)
        elif op == WRITE:
            L, two, bs, _, D = runner.block_shape
            full = torch.empty(
                (len(body), L, two, bs, heads.total, D),
                dtype=runner.kv_caches[0].dtype,
                device=runner.device,
            )
            channel.broadcast(full)
            runner.write_cache(body, heads.local(full))
        elif op == CAPTURE:
            runner.capture_decode_graphs(counts[0], counts[1])
        elif op == DECODE:
            replay(runner, channel, decode_decode(counts, body))
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


def replay(runner: ModelRunner, channel: StepChannel, step: DecodeInputs) -> None:
    """Rank 0's decode step through this rank's graph of the same padded size."""
    if runner.decode_graphs is None:
        raise RuntimeError("a DECODE op reached a rank that captured no decode graphs")
    token_ids: list[int] | torch.Tensor | None = step.token_ids
    if token_ids is None:  # rank 0's device tensor, broadcast behind the op
        token_ids = torch.empty(len(step.positions), dtype=torch.int64, device=runner.device)
        channel.broadcast(token_ids)
    runner.decode_graphs.run(token_ids, step.positions, step.block_tables)


def watch_parent(parent: int) -> None:
    """Exit at once when the process that started this one is gone (NCCL ops never notice)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--config", required=True, help="the worker's EngineConfig as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} %(name)s: %(message)s",
    )
    watch_parent(args.parent)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it waits
    base = EngineConfig(**json.loads(args.config))
    device = rank_device(base.device, args.rank)
    config = dataclasses.replace(base, device=device).resolved()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, is_master=False, timeout=GROUP_TIMEOUT)
    store.set(f"joined/{args.rank}", "1")
    tp = join_group(store, args.rank, args.size, device)
    loaded = load_shard(config, tp)
    channel = StepChannel(tp.group, torch.device(device))
    op, counts, _ = channel.recv()
    if op == SHUTDOWN:  # rank 0 stopped before its engine started
        dist.destroy_process_group()
        return 0
    if op != INIT:
        raise RuntimeError(f"expected INIT first, got op {op}")
    blocks = BlockManager(counts[0], config.block_size, enable_prefix_caching=False)
    runner = ModelRunner(
        loaded.model, loaded.spec, blocks, dtype=config.torch_dtype, device=torch.device(device)
    )
    heads = HeadMap.exchange(loaded.spec, args.rank, tp.group, torch.device(device))
    follow(runner, channel, heads)
    release_graphs(runner)  # before the group: see TPModelRunner.close
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
