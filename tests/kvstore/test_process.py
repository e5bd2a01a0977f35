"""The kvstore as a real process on loopback: health, put/get, SIGTERM drain with exit code 0."""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.services.worker.kvstore_client import KVStoreClient
from llmfleet.shared.wire.transport import frame_tensor, kv_layout_key, tensor_frame

pytestmark = pytest.mark.timeout(60)

SHAPE = (2, 2, 4, 2, 8)
LAYOUT = kv_layout_key("tiny", 2, 4, 2, 8, "float32")
READY = re.compile(r"kvstore ready: grpc=(\S+) data=(\S+) events=(\S+)")


def wait_for_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 20) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = READY.search(log.read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"kvstore exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"kvstore not ready in {timeout_s} s:\n{log.read_text()}")


async def wait_serving(address: str, timeout_s: float = 10) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{address} not SERVING after {timeout_s} s")
            await asyncio.sleep(0.05)


async def traffic(address: str, endpoint: str) -> None:
    await wait_serving(address)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    blocks = [torch.randn(SHAPE) for _ in hashes]
    async with KVStoreClient(address, endpoint, timeout_s=5) as client:
        assert await client.put(LAYOUT, hashes, [tensor_frame(b) for b in blocks]) == 3
        assert await client.lookup(LAYOUT, hashes) == 3
        frames = await client.get(LAYOUT, hashes)
        for f, b in zip(frames, blocks, strict=True):
            assert torch.equal(frame_tensor(f, torch.float32, SHAPE), b)


def test_process_serves_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "kvstore.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmfleet.services.kvstore",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--ram-bytes",
                "65536",
                "--disk-dir",
                str(tmp_path / "disk"),
                "--disk-bytes",
                str(1 << 20),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        m = wait_for_ready(proc, log)
        address, endpoint = m.group(1), m.group(2)
        assert endpoint.startswith("tcp://127.0.0.1:")
        asyncio.run(asyncio.wait_for(traffic(address, endpoint), 20))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stdout is not None and proc.stdout.read() == b""  # logs go to stderr only
        assert "kvstore data plane closed" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_flags_exit_with_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "llmfleet.services.kvstore", "--ram-bytes", "0"],
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert b"ram_bytes" in proc.stderr
