"""A worker whose forward pass fails (`--fault-inject-step`, simulated workers on loopback):
its streams move to a healthy worker and complete with every token, or end with a non-OK
status that names the failure; it turns NOT_SERVING and exits non-zero; the fleet keeps
serving on the other worker."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from fault_fleet import health, wait_until
from grpc_health.v1 import health_pb2
from tiny_models import sim_checkpoint

from llmfleet.cli.fleet_plan import FleetSpec, pick_free_ports
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient, ClientError, GenerationClient

SIMULATED = {"simulate": True, "sim_step_ms": 5.0, "sim_prefill_ms_per_token": 0.0}
MAX_TOKENS = 30
FAULT_STEP = 10  # the faulty worker's streams have some tokens by then, never all of them


async def _stream(client: AsyncGenerationClient, i: int) -> tuple[int, str | None] | str:
    """(tokens, finish reason), or 'CODE: message' when the stream failed."""
    tokens, finish = 0, None
    try:
        async for delta in client.stream(
            token_ids=[100 + i] * (8 + i), max_tokens=MAX_TOKENS, ignore_eos=True
        ):
            tokens += len(delta.token_ids)
            finish = delta.finish_reason or finish
    except ClientError as exc:
        return f"{exc.code_name}: {exc.message}"
    return tokens, finish


async def _streams(endpoint: str, count: int) -> list[tuple[int, str | None] | str]:
    async with AsyncGenerationClient(endpoint) as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(count)))


def _spec(tmp_path: Path, **kwargs) -> FleetSpec:
    return FleetSpec(
        port=0,
        model=sim_checkpoint(),
        engine=SIMULATED,
        kvstore=False,
        routing_policy="round_robin",
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=120,
        **kwargs,
    )


def _start_faulty(fleet: Fleet, like: int, fault_step: int, log: Path) -> subprocess.Popen:
    """One more worker like the fleet's worker `like` (its role, model, router), whose
    forward pass fails from engine step `fault_step` on; returned once it registered."""
    argv = list(fleet.workers[like].argv)
    port = pick_free_ports(1)[0]
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--metrics-port") + 1] = str(pick_free_ports(1)[0])
    argv[argv.index("--worker-id") + 1] = "faulty"
    argv += ["--fault-inject-step", str(fault_step)]
    with open(log, "w") as out:
        faulty = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    serving = health_pb2.HealthCheckResponse.SERVING
    wait_until(lambda: health(f"127.0.0.1:{port}") == serving, "the faulty worker to serve", 60)
    with GenerationClient(fleet.endpoint) as c:
        n = len(fleet.workers) + 1
        wait_until(lambda: len(c.server_info().workers) == n, f"{n} registered workers", 60)
    return faulty


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    """One worker: healthy for the first test, made to fail in the last (its own fleet each
    would cost another start of every process)."""
    with Fleet(_spec(tmp_path_factory.mktemp("aggregated"), workers=1)) as fleet:
        yield fleet


def test_streams_on_a_failing_worker_move_to_the_healthy_one(aggregated, tmp_path):
    fleet = aggregated
    faulty = _start_faulty(fleet, 0, FAULT_STEP, tmp_path / "faulty.log")
    try:
        results = asyncio.run(_streams(fleet.endpoint, 8))

        # No stream saw OK with tokens missing: each completed in full (on the healthy
        # worker, moved there mid-stream) or failed naming the worker failure.
        for r in results:
            if isinstance(r, str):
                assert r.startswith(("UNAVAILABLE", "INTERNAL")), r
                assert "forward pass failed" in r, r
            else:
                assert r == (MAX_TOKENS, "length")
        assert faulty.wait(timeout=60) != 0  # it exited, non-zero, for a supervisor
        log_text = (tmp_path / "faulty.log").read_text()
        assert "fault injected at engine step" in log_text
        assert "handing its requests back" in log_text
        with GenerationClient(fleet.endpoint) as c:  # it left the router's pool
            assert [w.address for w in c.server_info().workers] == fleet.worker_addresses
        # The fleet goes on serving on the healthy worker.
        assert asyncio.run(_streams(fleet.endpoint, 4)) == [(MAX_TOKENS, "length")] * 4
    finally:
        if faulty.poll() is None:
            faulty.kill()
            faulty.wait()


def test_the_only_worker_failing_ends_its_streams_with_a_status_naming_it(aggregated):
    fleet = aggregated
    worker = fleet.child("worker-0")  # the fleet's only worker, started again failing
    worker.argv += ["--fault-inject-step", str(FAULT_STEP)]
    fleet.restart("worker-0", kill=False)  # drained: it deregisters, then registers anew
    with GenerationClient(fleet.endpoint) as c:
        wait_until(lambda: len(c.server_info().workers) == 1, "worker-0 registered again", 60)
    results = asyncio.run(_streams(fleet.endpoint, 4))
    assert all(isinstance(r, str) for r in results), results
    for r in results:
        assert r.startswith("UNAVAILABLE"), r
        assert "forward pass failed" in r and "fault injected" in r, r


def test_a_failing_prefill_worker_hands_its_prefills_to_the_other(tmp_path):
    """Disaggregated: prefills on a prefill worker whose first step fails are retried on the
    healthy one; every stream completes in full."""
    spec = _spec(
        tmp_path,
        disaggregated=True,
        extra_args={"router": ["--short-prompt-threshold", "8"]},
    )
    with Fleet(spec) as fleet:
        prefill = next(i for i, w in enumerate(fleet.workers) if w.role == "prefill")
        faulty = _start_faulty(fleet, prefill, 1, tmp_path / "faulty.log")
        try:
            assert asyncio.run(_streams(fleet.endpoint, 6)) == [(MAX_TOKENS, "length")] * 6
            assert faulty.wait(timeout=60) != 0
            assert "fault injected at engine step 1" in (tmp_path / "faulty.log").read_text()
        finally:
            if faulty.poll() is None:
                faulty.kill()
                faulty.wait()
