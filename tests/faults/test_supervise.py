"""`llmfleet up`'s supervision on a real fleet (simulated workers, kvstore, gateway): kill -9 of
any child is repaired without an operator. A killed worker's streams complete through
migration; every killed child is started again at its address and counted in
`llmfleet:child_restarts_total`; afterwards the fleet serves (gRPC and HTTP)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from fault_fleet import Streams, health, http_status, sim_spec, wait_until, wait_until_async
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from llmfleet.cli.fleet_plan import Child
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.supervisor import Supervisor
from llmfleet.client.generation import AsyncGenerationClient, GenerationClient

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    spec = sim_spec(
        tmp_path_factory.mktemp("supervise"), kvstore=True, gateway=True, metrics_port=0
    )
    with Fleet(spec) as f:
        yield f


def _restarts(fleet: Fleet) -> dict[str, float]:
    """llmfleet:child_restarts_total by child, from the supervisor's /metrics."""
    assert fleet.metrics_url is not None
    with urllib.request.urlopen(fleet.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.labels["child"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmfleet:child_restarts_total"
    }


def _wait_serving(fleet: Fleet) -> None:
    for c in fleet.children:
        if c.kind == "gateway":
            wait_until(lambda: http_status(f"{fleet.http_url}/health") == 200, "the gateway", 60)
        else:
            wait_until(lambda c=c: health(c.address) == SERVING, f"{c.name} SERVING", 60)


def _generate_ok(fleet: Fleet) -> None:
    """One gRPC generation and one HTTP completion, each with all its tokens."""
    with GenerationClient(fleet.endpoint) as client:
        result = client.generate(token_ids=[11, 12, 13], max_tokens=8, ignore_eos=True)
    assert result.usage is not None and result.usage.completion_tokens == 8
    body = json.dumps({"model": _model(fleet), "prompt": "hi", "max_tokens": 8, "ignore_eos": True})
    req = urllib.request.Request(
        f"{fleet.http_url}/v1/completions",
        body.encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 8


def _model(fleet: Fleet) -> str:
    with urllib.request.urlopen(f"{fleet.http_url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def test_killed_worker_streams_migrate_and_it_is_restarted_and_counted(fleet):
    _wait_serving(fleet)
    worker = fleet.child("worker-0")
    old = worker.proc
    assert old is not None

    async def scenario() -> list:
        streams = Streams(fleet.endpoint, 12, MAX_TOKENS)
        async with AsyncGenerationClient(fleet.endpoint) as client:
            task = asyncio.ensure_future(streams.run(client))
            await wait_until_async(lambda: streams.started == 12, "every stream streaming")
            old.kill()
            return await task

    assert asyncio.run(scenario()) == [(MAX_TOKENS, "length")] * 12
    assert old.wait(timeout=10) == -9
    wait_until(lambda: _restarts(fleet).get("worker-0") == 1.0, "worker-0's restart counted")
    assert fleet.num_restarts("worker-0") == 1 and worker.proc is not old
    _wait_serving(fleet)  # at the same address
    with GenerationClient(fleet.endpoint) as client:
        wait_until(lambda: len(client.server_info().workers) == 2, "worker-0 registered again")
    _generate_ok(fleet)


@pytest.mark.parametrize("name", ["router", "tokenizer", "kvstore", "gateway"])
def test_killed_service_is_restarted_and_the_fleet_serves_again(fleet, name):
    _wait_serving(fleet)
    child = fleet.child(name)
    old = child.proc
    assert old is not None
    before = fleet.num_restarts(name)
    outcome: list[object] = []
    if name == "router":  # a stream on the killed router fails visibly, never short and OK

        async def in_flight() -> None:
            streams = Streams(fleet.endpoint, 1, 400)
            async with AsyncGenerationClient(fleet.endpoint) as client:
                task = asyncio.ensure_future(streams.run(client))
                await wait_until_async(lambda: streams.started == 1, "the stream streaming")
                old.kill()
                outcome.extend(await task)

        asyncio.run(in_flight())
        assert outcome[0] in ("UNAVAILABLE", "CANCELLED", (400, "length"))
    else:
        old.kill()
    assert old.wait(timeout=10) == -9
    wait_until(lambda: fleet.num_restarts(name) == before + 1, f"{name} restarted")
    assert _restarts(fleet).get(name) == before + 1
    _wait_serving(fleet)
    _generate_ok(fleet)


def test_a_crash_looping_child_is_restarted_with_capped_growing_delays(tmp_path):
    """A child that exits at once is started again after 0.1, 0.2, 0.4, 0.4, ... s: a crash
    loop costs a start per capped backoff, and the other children are left alone."""
    crash = Child("crash", "worker", "-", [sys.executable, "-c", "exit(3)"], tmp_path / "c.log")
    steady = Child("steady", "router", "-", [sys.executable, "-c", "input()"], tmp_path / "s.log")

    def launch(c: Child) -> None:
        c.proc = subprocess.Popen(c.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)

    for c in (crash, steady):
        launch(c)
    sup = Supervisor(
        [crash, steady], launch, threading.Lock(), min_backoff_s=0.1, max_backoff_s=0.4
    )
    started = time.monotonic()
    sup.start()
    try:
        wait_until(lambda: sup.num_restarts.get("crash", 0) >= 5, "five restarts", 20)
        elapsed = time.monotonic() - started
    finally:
        sup.stop()
        assert steady.proc is not None
        steady.proc.kill()
        steady.proc.wait()
    assert elapsed >= 0.1 + 0.2 + 0.4 + 0.4 + 0.4
    labels = {"service": "worker", "child": "crash"}
    assert sup.registry.get_sample_value("llmfleet:child_restarts_total", labels) >= 5
    assert "steady" not in sup.num_restarts
