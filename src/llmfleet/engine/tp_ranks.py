"""Starting and stopping a tensor-parallel worker's ranks, from rank 0 (the engine's process).

    ranks = Ranks(config)      # starts ranks 1..N-1 (`python -m llmfleet.engine.tp_follower`)
                               # and joins them in one process group: gloo on the CPU, NCCL on
                               # CUDA (rank r on cuda:r, counted from the configured device)
    load this rank's shard with `ranks.tp`; the engine's TPModelRunner drives the followers
    ranks.num_blocks(n)        # the KV blocks every rank holds: the smallest rank's count
    ranks.close()              # SHUTDOWN, all ranks leave the group together; a follower that
                               # does not exit is killed

Rendezvous: rank 0 hosts a TCPStore on a free port; each follower connects (at 127.0.0.1) and
says it is there before all join the group. Meanwhile rank 0 watches the followers: one that
exits fails the start at once, not after a timeout.

Across machines (`tp_local_ranks` L < N): rank 0 starts ranks 1..L-1 only and hosts the store
at `tp_port` (every interface), with its config under `CONFIG_KEY`; ranks L..N-1 are
`llmfleet worker --tp-join HOST:PORT --tp-rank R` processes on other machines
(`tp_follower.join_leader`), each on its own device, which rank 0 waits for as for its own.

Closing: after SHUTDOWN each follower sets `left/<rank>` in the store and leaves the group
(`leave_group`: NCCL's communicator aborted, since a graceful ncclCommDestroy waits on the other
ranks; gloo's destroyed); rank 0 waits for every `left` key, leaves too, and only then waits for
the exits. (A follower's graceful destroy used to block until rank 0 killed it.)

Failures: a follower that died fails rank 0's next op (`check`) or the op in progress (gloo:
its connection closes), so the worker's forward pass fails loudly. Followers exit when rank 0
does: their op fails the same way, and each also watches its parent process.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from llmfleet.engine.tp_step import SHUTDOWN, SIZE, StepChannel
from llmfleet.models.loader import LoadedModel
from llmfleet.models.parallel import TensorParallel
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.core.host import device_uuid, host_id

if TYPE_CHECKING:
    from llmfleet.kernels.all_reduce import PeerAllReduce

logger = logging.getLogger(__name__)

# Followers wait in a broadcast for rank 0's next op for as long as the worker is idle.
GROUP_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT_S = 300.0  # followers start (import torch) and reach the store within this
LEAVE_TIMEOUT_S = 10.0  # followers leave the group and exit within this of SHUTDOWN
CONFIG_KEY = "config"  # rank 0's EngineConfig as JSON, for the ranks that join it


def leader_config(store: dist.Store) -> EngineConfig:
    """Rank 0's EngineConfig, as it put it in the store (`CONFIG_KEY`). Followers never draft
    (rank 0's proposer drafts and its steps carry the drafts as rows): speculation is dropped."""
    return EngineConfig(**{**json.loads(store.get(CONFIG_KEY)), "speculative": None})


def leave_group() -> None:
    """This rank's part of closing the group. NCCL: abort the communicator (ncclCommAbort
    returns at once; a graceful destroy can wait on the other ranks, and a 2-GPU run with it
    hung); gloo: destroy it."""
    if dist.get_backend() == "nccl":
        _abort_process_group()
    else:
        dist.destroy_process_group()


def left_key(rank: int) -> str:
    """The store key a follower sets once it has left its loop and is leaving the group."""
    return f"left/{rank}"


class RankFailed(LLMFleetError):
    """A tensor-parallel rank exited or could not join its group."""


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` after the configured one."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_group(
    store: dist.Store, rank: int, size: int, device: str, all_reduce: str = "auto"
) -> tuple[TensorParallel, StepChannel]:
    """Join the ranks' process group (every rank calls it): this rank's place, and the channel
    rank 0's ops travel on (its ops over a second, gloo group when the ranks' group is NCCL).
    `all_reduce` "auto": small sums over GPUs of one host take the one-shot all-reduce."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = backend_for(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    host = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend == "nccl" else None
    tp = TensorParallel(rank=rank, size=size, group=None)  # None: the default group
    if host is not None and all_reduce == "auto":
        tp = dataclasses.replace(tp, peer=peer_all_reduce(tp, torch.device(device), host))
    return tp, StepChannel(tp.group, torch.device(device), host)


def peer_all_reduce(
    tp: TensorParallel, device: torch.device, host: dist.ProcessGroup
) -> PeerAllReduce | None:
    """The group's one-shot all-reduce (kernels/all_reduce.py) where every rank is a GPU of
    this host that can read the others' memory; else None (NCCL takes every sum). Every rank
    calls it, and all get one or all get None."""
    where: list[tuple[str, str] | None] = [None] * tp.size
    dist.all_gather_object(where, (host_id(), device_uuid(device.index or 0)), group=host)
    hosts = {w[0] for w in where if w is not None}
    uuids = [w[1] for w in where if w is not None]
    reason = ""
    if len(hosts) > 1 or "" in hosts:
        reason = "the ranks are on several hosts (or a host's identity is unknown)"
    else:
        index = {device_uuid(i): i for i in range(torch.cuda.device_count())}
        here = device.index or 0
        if any(u not in index for u in uuids):
            reason = "a rank's GPU is not visible to every rank"
        elif any(
            index[u] != here and not torch.cuda.can_device_access_peer(here, index[u])
            for u in uuids
        ):
            reason = "a rank's GPU cannot read another's memory"
    peer, error = None, reason
    if not reason:
        from llmfleet.kernels.all_reduce import PeerAllReduce  # Triton: GPUs only

        try:
            peer = PeerAllReduce(tp.group, device)
        except Exception as e:  # symmetric memory unavailable here: NCCL serves
            error = f"symmetric memory failed: {e}"
    errors: list[str | None] = [None] * tp.size
    dist.all_gather_object(errors, error, group=host)
    failed = [e for e in errors if e]
    if failed:
        logger.info("tensor parallel: NCCL takes every all-reduce (%s)", failed[0])
        return None
    logger.info("tensor parallel: one-shot all-reduce over the GPUs' memory for small sums")
    return peer


class Ranks:
    """Rank 0's handle on the other ranks of its group (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RankFailed("this process already runs a tensor-parallel group: close it first")
        local = config.tp_local_ranks or size
        port = config.tp_port if local < size else 0
        store = dist.TCPStore(
            "127.0.0.1", port, size, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT
        )
        store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))  # `leader_config`
        argv = [sys.executable, "-m", "llmfleet.engine.tp_follower"]
        argv += ["--size", str(size), "--port", str(store.port), "--parent", str(os.getpid())]
        self.procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(1, local)]
        self.size = size
        if local < size:
            logger.info(
                "tensor parallel: ranks %d..%d join at port %d", local, size - 1, store.port
            )
        self._closed = False
        # An op was sent and rank 0's part of it has not finished (`done`): after a failure
        # the followers may be inside it, so `close` kills them instead of sending SHUTDOWN.
        self.pending = False
        try:
            self._wait_joined(store, size)
            device = rank_device(config.device, 0)
            self.tp, self.channel = join_group(store, 0, size, device, config.tp_all_reduce)
        except BaseException:
            self._kill()
            raise
        self._store = store  # the group's rendezvous: kept while the group lives
        atexit.register(self.close)
        logger.info("tensor parallel: %d ranks (%s)", size, backend_for(config.device))

    def _wait_joined(self, store: dist.Store, size: int) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        keys = [f"joined/{r}" for r in range(1, size)]
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not store.check([k])]
                raise RankFailed(
                    f"tensor-parallel ranks did not join in {JOIN_TIMEOUT_S:.0f} s: {missing}"
                )
            time.sleep(0.05)

    def send(self, op: int, counts: list[int], body: list[int] | None = None) -> None:
        """Send the followers their next op (tp_step.py); `done` once rank 0's part is."""
        self.check()  # a follower gone fails the op loudly, before it is sent
        self.pending = True
        self.channel.send(op, counts, body)

    def done(self) -> None:
        self.pending = False

    def num_blocks(self, own: int) -> int:
        """The KV cache's block count for every rank: the smallest of each rank's own count
        (`own` is rank 0's), since every rank allocates as many blocks, each of its heads."""
        self.send(SIZE, [own])
        agreed = self.channel.min_over(own)
        self.done()
        if agreed < own:
            logger.info("KV cache: %d blocks, a follower rank's memory holds no more", agreed)
        return agreed

    def check(self) -> None:
        """Raise RankFailed if a follower has exited."""
        for r, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                raise RankFailed(f"tensor-parallel rank {r} exited with status {code}")

    def close(self) -> None:
        """Stop the followers: SHUTDOWN when they wait for an op and all live, then every rank
        leaves the group together (see the module docstring). Else (a failed op may have left
        them inside it), or when one does not leave in time, kill them and abort the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        left = False
        if not self.pending and all(p.poll() is None for p in self.procs):
            try:
                self.channel.send(SHUTDOWN, [])
                left = self._wait_left()
            except Exception as e:  # a follower died meanwhile: it is killed below
                logger.warning("tensor parallel: shutdown not delivered: %s", e)
        if left:
            leave_group()  # with the followers, each leaving its own
            deadline = time.monotonic() + LEAVE_TIMEOUT_S
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("tensor-parallel rank pid %d did not exit: killing", proc.pid)
            self._kill()
            return
        self._kill()
        _abort_process_group()  # a graceful NCCL teardown would wait for the killed ranks

    def _wait_left(self) -> bool:
        """Whether every follower said it left its loop (`left_key`) in time; False at once
        when one exits first."""
        keys = [left_key(r) for r in range(1, self.size)]
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while not self._store.check(keys):
            if any(p.poll() is not None for p in self.procs):
                logger.warning("tensor parallel: a follower exited before leaving the group")
                return False
            if time.monotonic() > deadline:
                logger.warning("tensor parallel: followers did not leave in time: killing")
                return False
            time.sleep(0.01)
        return True

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@dataclass
class TPLoadedModel(LoadedModel):
    """Rank 0's shard of a tensor-parallel worker's model, with the ranks holding the rest."""

    ranks: Ranks
