"""`llmfleet <service> ARGS...`: each service's own command line (the images' entry points).

Each is the same program as `python -m llmfleet.services.<service>`: the same help (bar the
program name), the same exit status 2 naming a bad flag, and a service that serves and drains.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.cli.services import SERVICES, service_parser

pytestmark = pytest.mark.timeout(60)

NAMES = ["router", "worker", "tokenizer", "kvstore", "gateway"]
WIDE = {**os.environ, "COLUMNS": "400"}  # help text wraps to the terminal's width


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=30, env=WIDE
    )


def test_every_service_has_an_entry_point() -> None:
    assert sorted(SERVICES) == sorted(NAMES)
    listing = _run("-m", "llmfleet.cli.main", "--help")
    assert listing.returncode == 0
    for name in NAMES:
        assert f"`llmfleet {name} --help`" in listing.stdout


@pytest.mark.parametrize("name", NAMES)
def test_help_is_the_services_own(name: str) -> None:
    ours = _run("-m", "llmfleet.cli.main", name, "--help")
    module = _run("-m", f"llmfleet.services.{name}", "--help")
    assert ours.returncode == 0 and module.returncode == 0, ours.stderr + module.stderr
    assert ours.stdout.startswith(f"usage: llmfleet {name} [-h] [--host HOST] [--port PORT]")
    theirs = module.stdout.replace(f"python -m llmfleet.services.{name}", f"llmfleet {name}")
    assert ours.stdout.split() == theirs.split()  # the same words; usage wraps by prog length


@pytest.mark.parametrize("name", NAMES)
def test_bad_flag_exits_2_naming_it(name: str) -> None:
    proc = _run("-m", "llmfleet.cli.main", name, "--port", "1", "--no-such-flag", "3")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"llmfleet {name}: error: unrecognized arguments: --no-such-flag 3" in proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_service_parser_parses_the_services_flags(name: str) -> None:
    parser = service_parser(name)
    assert parser.prog == f"llmfleet {name}"
    args = parser.parse_args(["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"])
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", 50051, 9100)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--port", "not-a-port"])
    assert exc.value.code == 2


def test_value_flags_reach_the_service_config() -> None:
    """A bad value is the service's own configuration error, not the CLI's."""
    proc = _run("-m", "llmfleet.cli.main", "kvstore", "--ram-bytes", "0")
    assert proc.returncode == 2
    assert "llmfleet kvstore: error:" in proc.stderr and "ram_bytes" in proc.stderr


async def _wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert proc.poll() is None, f"exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{address} not SERVING after {timeout_s} s"
            await asyncio.sleep(0.05)


def test_kvstore_entry_point_serves_and_drains(tmp_path: Path) -> None:
    log = tmp_path / "kvstore.log"
    argv = ["kvstore", "--port", "0", "--metrics-port", "0", "--data-port", "0"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmfleet.cli.main", *argv, "--ram-bytes", "65536"],
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 20
        while not (m := re.search(r"kvstore ready: grpc=(\S+)", log.read_text())):
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()}"
            time.sleep(0.05)
        asyncio.run(_wait_serving(m.group(1), proc, timeout_s=10))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stdout is not None and proc.stdout.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
