"""Helpers for gateway tests: a fleet started by `llmfleet up` (as a user starts it), a gateway
served in this process, and waiting for the fleet's workers to go idle."""

from __future__ import annotations

import asyncio
import os
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from llmfleet.client.generation import GenerationClient
from llmfleet.services.gateway.server import bound_address, build_server
from llmfleet.shared.core.config import AuthConfig, GatewayConfig
from llmfleet.v1 import worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class UpFleet:
    endpoint: str  # gRPC, from the first line `llmfleet up` prints
    base_url: str  # http://HOST:PORT/v1, from its second line
    worker_addresses: list[str]
    log_dir: Path
    # Each service's Prometheus endpoint by name, from the lines that follow (gateway last).
    metrics_urls: dict[str, str] = field(default_factory=dict)


@contextmanager
def llmfleet_up(
    model: str, log_dir: Path, env: Mapping[str, str], timeout_s: float = 180.0
) -> Iterator[UpFleet]:
    """`llmfleet up --port 0 --http-port 0` (one worker, no kvstore); SIGINT at the end."""
    cmd = [sys.executable, "-m", "llmfleet.cli.main", "up", "--port", "0", "--http-port", "0",
           "--model", model, "--no-kvstore", "--quiet", "--log-dir", str(log_dir),
           "--startup-timeout", str(timeout_s)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        serving, api = proc.stdout.readline(), proc.stdout.readline()
        if not api.startswith("llmfleet: OpenAI-compatible API on http://"):
            proc.kill()
            raise AssertionError(f"llmfleet up printed {serving!r} {api!r}: {proc.stderr.read()}")
        endpoint = serving.split()[-1]
        metrics: dict[str, str] = {}
        while "gateway" not in metrics:  # `llmfleet: metrics of NAME on URL`
            words = proc.stdout.readline().split()
            assert words[:3] == ["llmfleet:", "metrics", "of"], words
            metrics[words[3]] = words[-1]
        with GenerationClient(endpoint) as client:
            workers = [w.address for w in client.server_info().workers]
        yield UpFleet(endpoint, api.split()[-1], workers, log_dir, metrics)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_workers_idle(addresses: list[str], timeout_s: float) -> list[Any]:
    """Poll GetWorkerStats until no worker runs or queues anything and every KV block is free;
    returns the last load reports (idle or not, for the caller to assert on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = []
        for address in addresses:
            with grpc.insecure_channel(address) as ch:
                stats = worker_pb2_grpc.WorkerStub(ch).GetWorkerStats(
                    worker_pb2.GetWorkerStatsRequest(), timeout=10
                )
            loads.append(stats.load)
        if time.monotonic() > deadline or all(
            x.num_running == 0 and x.num_waiting == 0 and x.num_free_blocks == x.num_total_blocks
            for x in loads
        ):
            return loads
        time.sleep(0.1)


@contextmanager
def gateway_in_thread(
    config: GatewayConfig, tokenizer: Any, auth: AuthConfig | None = None
) -> Iterator[str]:
    """Serve the gateway app from a thread of this process; yields its base URL (.../v1)."""
    server = build_server(config, tokenizer=tokenizer, auth=auth)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://{bound_address(server)}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


def a_stop_string(text: str) -> str:
    """A character of `text` (not its first) to stop at, e.g. 'k' in 'ak3'."""
    for k, ch in enumerate(text):
        if k > 0 and ch in string.ascii_letters + string.digits and text.index(ch) == k:
            return ch
    raise AssertionError(f"no usable stop character in {text!r}")
