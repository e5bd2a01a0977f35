"""A forward-pass fault under `llmfleet up`'s supervision, as one flow (simulated workers on
loopback): the faulty worker's streams finish on the other worker with every token (no client
sees OK with tokens missing), the worker exits 1, the supervisor starts it again without an
operator, and it serves requests again."""

from __future__ import annotations

import asyncio

import pytest
from fault_fleet import Streams, health, sim_spec, wait_until, worker_stats
from grpc_health.v1 import health_pb2

from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient, GenerationClient

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 60
FAULT_STEP = 15  # the faulty worker's streams have some tokens by then, never all of them


def test_a_worker_whose_forward_pass_fails_is_restarted_and_serves_again(tmp_path):
    spec = sim_spec(tmp_path, routing_policy="round_robin", metrics_port=0)
    with Fleet(spec) as fleet:
        worker = fleet.child("worker-0")
        clean = list(worker.argv)
        # This incarnation's forward pass fails from step FAULT_STEP on; the one the
        # supervisor starts after it is healthy (a transient fault that a restart clears).
        worker.argv[:] = [*clean, "--fault-inject-step", str(FAULT_STEP)]
        fleet.restart("worker-0")
        worker.argv[:] = clean
        faulty = worker.proc
        assert faulty is not None
        with GenerationClient(fleet.endpoint) as client:
            wait_until(lambda: len(client.server_info().workers) == 2, "both workers registered")

        async def streams() -> list:
            async with AsyncGenerationClient(fleet.endpoint) as client:
                return await Streams(fleet.endpoint, 12, MAX_TOKENS).run(client)

        assert asyncio.run(streams()) == [(MAX_TOKENS, "length")] * 12
        assert faulty.wait(timeout=30) == 1
        wait_until(lambda: fleet.num_restarts("worker-0") == 1, "the supervisor's restart", 30)
        assert worker.proc is not faulty
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(lambda: health(worker.address) == serving, "worker-0 SERVING again", 60)
        with GenerationClient(fleet.endpoint) as client:
            wait_until(lambda: len(client.server_info().workers) == 2, "worker-0 registered")
            for i in range(4):  # round robin: two land on the restarted worker
                result = client.generate(token_ids=[7, 8, 9 + i], max_tokens=8, ignore_eos=True)
                assert result.usage is not None and result.usage.completion_tokens == 8
        # the new process looked prompts up in its prefix cache: it served some of them
        assert worker_stats(worker.address).prefix_cache_queries > 0
