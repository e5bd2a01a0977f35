"""Helpers for tests that start real fleets (separate processes on loopback)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
import torch

from llmfleet.cli.launcher import Fleet
from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.v1 import worker_pb2, worker_pb2_grpc

NUM_BLOCKS = 512
WORKER_ARGS = ["--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "16"]


def reference_tokens(model: str, prompts: list[list[int]], params: SamplingParams):
    """Greedy tokens of the in-process engine: {prompt index: {completion index: tokens}}."""
    engine = LLMEngine(
        EngineConfig(block_size=16, num_kv_blocks=NUM_BLOCKS),
        load_model(model, dtype=torch.float32, progress=False),
    )
    out: dict[int, dict[int, list[int]]] = {i: {} for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id[1:])].setdefault(o.index, []).extend(o.new_token_ids)
    return out


def worker_stats(address: str) -> worker_pb2.GetWorkerStatsResponse:
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)


def wait_all_blocks_free(
    fleet: Fleet, timeout_s: float = 30.0
) -> list[worker_pb2.GetWorkerStatsResponse]:
    """Poll every worker until nothing runs or waits and every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [worker_stats(a) for a in fleet.worker_addresses]
        idle = all(
            s.load.num_running == 0
            and s.load.num_waiting == 0
            and s.load.num_free_blocks == s.load.num_total_blocks
            and s.load.num_active_leases == 0
            for s in stats
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def logged_endpoint(log: Path, pattern: str) -> str:
    """The first tcp:// endpoint a child logged after `pattern` (e.g. 'replies on')."""
    m = re.search(pattern + r"\s*(tcp://[\d.]+:\d+)", log.read_text())
    if m is None:
        raise AssertionError(f"{pattern!r} not found in {log}")
    return m.group(1)
