"""Helpers for the fault tests (supervision, drain, saturation): fleets of simulated workers on
loopback, streams driven from asyncio, and waits on conditions with deadlines."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_models import sim_checkpoint

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.client.generation import AsyncGenerationClient, ClientError
from llmfleet.v1 import worker_pb2, worker_pb2_grpc

# A step-time model in place of the forward pass: cheap on a 2-core machine, still streaming.
SIMULATED: dict[str, Any] = {
    "simulate": True,
    "sim_step_ms": 10.0,
    "sim_decode_ms_per_seq": 0.02,
    "sim_prefill_ms_per_token": 0.0,
}


def sim_spec(tmp_path: Path, **kwargs: Any) -> FleetSpec:
    engine = {**SIMULATED, **kwargs.pop("engine", {})}
    defaults: dict[str, Any] = {
        "port": 0,
        "workers": 2,
        "model": sim_checkpoint(),
        "engine": engine,
        "kvstore": False,
        "http_port": 0,
        "log_dir": str(tmp_path / "logs"),
        "startup_timeout_s": 120.0,
        "grace_s": 30.0,
        "restart_backoff_s": 0.2,
        "max_restart_backoff_s": 2.0,
    }
    return FleetSpec(**{**defaults, **kwargs})


def wait_until(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


async def wait_until_async(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


def health(address: str) -> int | None:
    """The gRPC health status of `address` ("" service), None while it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            req = health_pb2.HealthCheckRequest()
            return health_pb2_grpc.HealthStub(ch).Check(req, timeout=2).status
        except grpc.RpcError:
            return None


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def worker_stats(address: str) -> worker_pb2.GetWorkerStatsResponse:
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        return stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)


def all_blocks_free(addresses: list[str]) -> bool:
    """Every worker answers, runs nothing, queues nothing and has every KV block free."""
    try:
        stats = [worker_stats(a) for a in addresses]
    except grpc.RpcError:  # one is (re)starting
        return False
    return all(
        s.load.num_running == 0
        and s.load.num_waiting == 0
        and s.load.num_free_blocks == s.load.num_total_blocks
        for s in stats
    )


class Streams:
    """`count` concurrent Generate streams; `started` counts those that got a token."""

    def __init__(self, endpoint: str, count: int, max_tokens: int) -> None:
        self.endpoint = endpoint
        self.count = count
        self.max_tokens = max_tokens
        self.started = 0
        self.done = 0

    async def one(self, client: AsyncGenerationClient, i: int) -> tuple[int, str | None]:
        stream = client.stream(
            token_ids=[100 + i % 50] * (8 + i % 16), max_tokens=self.max_tokens, ignore_eos=True
        )
        tokens, finish = 0, None
        async for delta in stream:
            if tokens == 0 and delta.token_ids:
                self.started += 1
            tokens += len(delta.token_ids)
            finish = delta.finish_reason or finish
        self.done += 1
        return tokens, finish

    async def run(self, client: AsyncGenerationClient) -> list[tuple[int, str | None] | str]:
        """Each stream's (tokens, finish reason), or the status name it failed with."""

        async def guarded(i: int) -> tuple[int, str | None] | str:
            try:
                return await self.one(client, i)
            except ClientError as exc:
                return exc.code_name

        return await asyncio.gather(*(guarded(i) for i in range(self.count)))


def num_on_workers(addresses: list[str]) -> int:
    """Requests the workers hold (running or queued)."""
    stats = [worker_stats(a) for a in addresses]
    return sum(s.load.num_running + s.load.num_waiting for s in stats)
