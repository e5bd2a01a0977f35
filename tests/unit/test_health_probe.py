"""`python -m llmfleet.shared.wire.health_probe`: the exec probe of a mutual-TLS gRPC port
(deploy/kubernetes/components/mtls). Exit 0 exactly when the named service answers SERVING,
with the fleet's certificate when the port requires one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from llmfleet.cli.tls_init import init_tls_dir
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.health_probe import main
from llmfleet.shared.wire.service import Service

pytestmark = pytest.mark.timeout(60)

NAME = "llmfleet.v1.Tokenizer"


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fleet-tls")
    init_tls_dir(d)
    return d


@asynccontextmanager
async def service(tls_dir: Path | None) -> AsyncIterator[Service]:
    svc = Service("tokenizer", "127.0.0.1", 0, metrics_port=None, tls=tls.load(tls_dir))
    await svc.start([NAME])  # NOT_SERVING until set_serving
    try:
        yield svc
    finally:
        svc.request_stop()
        await svc.wait_for_termination()


async def probe(*argv: str) -> int:
    return await asyncio.to_thread(main, ["--timeout-s", "2", *argv])


def test_serving_only_once_the_service_says_so(capsys):
    async def body() -> None:
        async with service(None) as svc:
            assert await probe(svc.address, "--service", NAME) == 1
            assert "NOT_SERVING" in capsys.readouterr().err
            await svc.set_serving()
            assert await probe(svc.address, "--service", NAME) == 0
            assert await probe(svc.address) == 0  # "": the server as a whole
            assert await probe(svc.address, "--service", "llmfleet.v1.Nope") == 1
            assert "NOT_FOUND" in capsys.readouterr().err
        assert await probe(svc.address, "--service", NAME) == 1  # stopped: no answer
        assert "UNAVAILABLE" in capsys.readouterr().err

    asyncio.run(body())


def test_a_mutual_tls_port_answers_only_with_the_fleet_certificate(tls_dir, tmp_path, capsys):
    other = tmp_path / "other-ca"
    init_tls_dir(other)

    async def body() -> None:
        async with service(tls_dir) as svc:
            await svc.set_serving()
            assert await probe(svc.address, "--service", NAME, "--tls-dir", str(tls_dir)) == 0
            assert await probe(svc.address, "--service", NAME) == 1  # plaintext: refused
            assert await probe(svc.address, "--service", NAME, "--tls-dir", str(other)) == 1
            # As the kubelet runs it: a process of its own.
            cmd = [sys.executable, "-m", "llmfleet.shared.wire.health_probe", svc.address]
            args = ["--service", NAME, "--tls-dir", str(tls_dir)]
            proc = await asyncio.to_thread(
                subprocess.run, [*cmd, *args], capture_output=True, text=True, timeout=30
            )
            assert proc.returncode == 0, proc.stderr

    asyncio.run(body())
    assert main(["127.0.0.1:1", "--tls-dir", str(tmp_path / "missing")]) == 1
    assert "tls_dir" in capsys.readouterr().err
