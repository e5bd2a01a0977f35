"""A follower rank of a tensor-parallel worker: `python -m llmfleet.engine.tp_follower`, started
by rank 0 (tp_ranks.py), never by hand; or, on another machine, `llmfleet worker --tp-join
HOST:PORT --tp-rank R` (`join_leader`), which takes the leader's config and watches that the
leader's rendezvous store is still there.

It joins the group, loads its shard of the model, tells rank 0 how many KV blocks its own memory
holds (SIZE: the group takes the smallest count), allocates its KV cache (INIT) and then runs
every op rank 0 sends (tp_step.py) until SHUTDOWN: the same forward pass with the same attention
metadata (the logits are rank 0's to sample), its heads of a KV read or write. On SHUTDOWN it
leaves the group together with rank 0 (tp_ranks.py) and exits 0; it exits non-zero when an op
fails, rank 0's connection closes or rank 0's process is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from llmfleet.engine import flops
from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.forward_pass import kv_cache_blocks, load_shard
from llmfleet.engine.model_runner import ModelRunner
from llmfleet.engine.tp_ranks import (
    CONFIG_KEY,
    GROUP_TIMEOUT,
    JOIN_TIMEOUT_S,
    join_group,
    leader_config,
    leave_group,
    left_key,
    rank_device,
)
from llmfleet.engine.tp_runner import release_graphs
from llmfleet.engine.tp_step import (
    CAPTURE,
    DECODE,
    INIT,
    READ,
    SHUTDOWN,
    SIZE,
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

JOIN_TIMEOUT = timedelta(seconds=JOIN_TIMEOUT_S)  # the leader's store is reached within this


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
    graphs = runner.decode_graphs
    if step.token_ids is not None:
        graphs.run(step.token_ids, step.positions, step.block_tables)
    else:  # rank 0's device tensor, broadcast behind the op into the graph's input
        ids = graphs.static.token_ids(len(step.positions))
        graphs.run(ids, step.positions, step.block_tables, channel.broadcast)


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
    args = p.parse_args(argv)
    log_as_rank(args.rank)
    watch_parent(args.parent)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it waits
    store = dist.TCPStore("127.0.0.1", args.port, args.size, is_master=False, timeout=GROUP_TIMEOUT)
    base = leader_config(store)
    config = dataclasses.replace(base, device=rank_device(base.device, args.rank)).resolved()
    return run(store, args.rank, config)


def log_as_rank(rank: int) -> None:
    """This process's log lines, on stderr, named after its rank."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s",
    )


def join_leader(own: EngineConfig) -> int:
    """Rank `own.tp_rank` of the group whose rank 0 listens at `own.tp_join` (another machine's
    worker, `tp_local_ranks` < N): the leader's config on this process's device and memory
    (`own`'s device, threads and KV cache budget). Exit status: 0 after SHUTDOWN, 1 when the
    leader cannot be reached or goes away, 2 when the group's size is not `own`'s or another
    process holds its rank."""
    if own.tp_join is None or own.tp_rank is None:
        raise ValueError("joining a tensor-parallel group needs tp_join and tp_rank")
    host, _, port = own.tp_join.rpartition(":")
    log_as_rank(own.tp_rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        store = dist.TCPStore(
            host, int(port), own.tensor_parallel_size, is_master=False, timeout=JOIN_TIMEOUT
        )
        leader = leader_config(store)
    except (RuntimeError, OSError) as e:  # (torch's DistNetworkError is a RuntimeError)
        logger.error("tensor-parallel leader at %s not reached: %s", own.tp_join, e)
        return 1
    if leader.tensor_parallel_size != own.tensor_parallel_size:
        logger.error(
            "the leader at %s runs %d ranks, this process was given --tensor-parallel-size %d",
            own.tp_join,
            leader.tensor_parallel_size,
            own.tensor_parallel_size,
        )
        return 2
    config = dataclasses.replace(
        leader,
        device=rank_device(own.device, 0),
        num_threads=own.num_threads,
        kv_cache_bytes=own.kv_cache_bytes,
        gpu_memory_utilization=own.gpu_memory_utilization,
        tp_local_ranks=None,
        tp_port=0,
        tp_join=own.tp_join,
        tp_rank=own.tp_rank,
    ).resolved()
    leaving = threading.Event()
    watch_leader(host, int(port), own.tensor_parallel_size, leaving)
    try:
        return run(store, own.tp_rank, config, leaving)
    except Exception as e:  # gloo: the leader's connection closed mid-op
        if leaving.is_set():
            raise
        logger.error("tensor-parallel leader at %s went away: %s", own.tp_join, e)
        return 1


def watch_leader(host: str, port: int, size: int, leaving: threading.Event) -> None:
    """Exit 1 at once when the leader's rendezvous store is gone (NCCL ops never notice),
    unless this rank is leaving the group after SHUTDOWN."""

    def watch() -> None:
        store = None
        while not leaving.wait(1.0):
            try:
                if store is None:
                    store = dist.TCPStore(host, port, size, is_master=False, timeout=JOIN_TIMEOUT)
                store.check([CONFIG_KEY])
            except Exception as e:
                if leaving.is_set():
                    return
                logger.error("tensor-parallel leader at %s:%d went away: %s", host, port, e)
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="leader-watch").start()


def run(
    store: dist.Store, rank: int, config: EngineConfig, leaving: threading.Event | None = None
) -> int:
    """Join the group as `rank`, load this rank's shard and run rank 0's ops until SHUTDOWN
    (`config` resolved, its device this rank's); `leaving` is set once SHUTDOWN came."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if store.add(f"claimed/{rank}", 1) > 1:  # two processes started as the same rank
        logger.error(
            "rank %d of this tensor-parallel group is taken: another process joined as it "
            "(give each joining worker its own --tp-rank; restart the group to rejoin)",
            rank,
        )
        return 2
    store.set(f"joined/{rank}", "1")
    size = config.tensor_parallel_size
    tp, channel = join_group(store, rank, size, config.device, config.tp_all_reduce)
    loaded = load_shard(config, tp)
    op, counts, _ = channel.recv()
    if op == SIZE:  # the KV blocks this rank's memory holds; every rank allocates the fewest
        shape = flops.model_shape(loaded.model, config.torch_dtype.itemsize)
        channel.min_over(kv_cache_blocks(config, loaded, shape, device))
        op, counts, _ = channel.recv()
    if op == SHUTDOWN:  # rank 0 stopped before its engine started
        leave(store, rank, leaving)
        return 0
    if op != INIT:
        raise RuntimeError(f"expected INIT first, got op {op}")
    blocks = BlockManager(counts[0], config.block_size, enable_prefix_caching=False)
    runner = ModelRunner(loaded.model, loaded.spec, blocks, dtype=config.torch_dtype, device=device)
    heads = HeadMap.exchange(loaded.spec, rank, tp.group, device)
    follow(runner, channel, heads)
    release_graphs(runner)  # before the group: see TPModelRunner.close
    leave(store, rank, leaving)
    return 0


def leave(store: dist.Store, rank: int, leaving: threading.Event | None) -> None:
    """Leave the group with rank 0, which leaves its own meanwhile (tp_ranks.py)."""
    if leaving is not None:
        leaving.set()  # rank 0 may be gone before this process is
    store.set(left_key(rank), "1")
    leave_group()


def exit_rank(code: int) -> NoReturn:
    """End a follower rank's process with `code`, without the interpreter's teardown: torch's
    C++ threads (the store client's, gloo's) can still be winding down after the group is
    left, and destroying them then aborted the process ("terminate called without an active
    exception", status -6) after a clean run, in about half the runs on a loaded CPU."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_rank(main())
