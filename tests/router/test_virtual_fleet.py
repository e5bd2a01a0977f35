"""The virtual-time fleet of benchmarks/routing_scale_bench.py: real engines, the router's
policies and candidates, on an event clock. Small fleets, a second or two of virtual time."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from virtual_fleet import Calibration, FleetShape, SimRequest, VirtualFleet  # noqa: E402

from llmfleet.engine.forward_pass import load_for  # noqa: E402

# Small and quick: 64 blocks of 16 tokens per worker, room for one tenant's prompt and a few
# questions at a time.
CALIB = Calibration(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def loaded():
    return load_for(CALIB.engine_config())


def tenants_workload(n: int, rate: float, seed: int = 0) -> list[SimRequest]:
    """Two tenants (each request picks one at random) with 800-token system prompts, 16-token
    questions, 4-token answers."""
    rng = random.Random(seed)
    system = [[rng.randrange(3, 40_000) for _ in range(800)] for _ in range(2)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        question = [rng.randrange(3, 40_000) for _ in range(16)]
        out.append(SimRequest(f"r{i}", t, system[rng.randrange(2)] + question, 4))
    return out


def run(loaded, shape: FleetShape, policy: str, n: int = 40, rate: float = 20.0):
    fleet = VirtualFleet(shape, CALIB, policy, loaded)
    return fleet, fleet.run(tenants_workload(n, rate))


@pytest.mark.parametrize(
    "shape",
    [FleetShape(2), FleetShape(2, kvstore=True), FleetShape(4, disaggregated=True)],
    ids=["aggregated", "kvstore", "disaggregated"],
)
def test_every_request_is_answered_in_full_on_the_virtual_clock(loaded, shape):
    fleet, done = run(loaded, shape, "predicted_ttft")
    assert sorted(r.rid for r in done) == sorted(f"r{i}" for i in range(40))
    assert all(r.num_output_tokens == 4 for r in done)
    assert all(0 < r.ttft and r.first_token_at <= r.finished_at for r in done)
    assert fleet.clock.now >= max(r.arrival for r in done)
    # Every worker ends idle, holding no request and no KV beyond its prefix cache.
    for w in fleet.by_id.values():
        assert not w.requests and not w.engine.has_unfinished()
        assert w.engine.num_free_blocks == CALIB.num_kv_blocks
    assert fleet.routed.requests == {} and fleet.routed.prefilling == {}
    assert fleet.routed.incoming == {}  # every fetch and push counted out again


def test_same_arrivals_same_figures(loaded):
    _, a = run(loaded, FleetShape(2), "predicted_ttft")
    _, b = run(loaded, FleetShape(2), "predicted_ttft")
    assert [(r.rid, r.ttft, r.num_cached_tokens) for r in a] == [
        (r.rid, r.ttft, r.num_cached_tokens) for r in b
    ]


def test_predicted_ttft_keeps_each_tenant_on_one_worker_where_round_robin_recomputes(loaded):
    """Each worker's cache holds one tenant's prompt: round robin alternates the tenants over
    both workers and evicts them; the scorer keeps each tenant where its prefix is cached."""
    _, rr = run(loaded, FleetShape(2), "round_robin", n=60)
    _, scored = run(loaded, FleetShape(2), "predicted_ttft", n=60)
    cached = {
        name: sum(r.num_cached_tokens for r in done[10:])
        for name, done in (("round_robin", rr), ("predicted_ttft", scored))
    }
    # Past the first requests, every one found its tenant's 800 tokens cached (50 blocks).
    assert cached["predicted_ttft"] == 50 * 800
    assert cached["predicted_ttft"] >= 1.5 * cached["round_robin"]
    mean_ttft = {
        name: sum(r.ttft for r in done) / len(done)
        for name, done in (("round_robin", rr), ("predicted_ttft", scored))
    }
    assert mean_ttft["predicted_ttft"] < mean_ttft["round_robin"]
