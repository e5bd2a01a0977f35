"""A real fleet whose router process is killed and started again mid-run: the workers
register with the new one, its router rebuilds each worker's KV view from snapshots, and
prefix-aware routing sends a request to the worker holding its prefix again."""

from __future__ import annotations

import time

import pytest
import torch
from fleet_helpers import WORKER_ARGS, worker_stats

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient

BLOCK = 16  # WORKER_ARGS' block size


@pytest.fixture(scope="module")
def fleet(make_checkpoint_module):
    spec = FleetSpec(
        port=0,
        workers=2,
        model=str(make_checkpoint_module("llama")),
        routing_policy="prefix_aware",
        kvstore=False,  # a worker's own cache is the only place a prefix can come from
        extra_args={"worker": WORKER_ARGS},
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


def queries(fleet) -> dict[str, int]:
    """Prompt tokens each worker has looked up in its prefix cache (one lookup per admission)."""
    return {w.name: worker_stats(w.address).prefix_cache_queries for w in fleet.workers}


def served_by(fleet, client, prompt: list[int]) -> tuple[str, int]:
    """(worker that admitted `prompt`, its cached prompt tokens)."""
    before = queries(fleet)
    result = client.generate(token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    after = queries(fleet)
    [worker] = [name for name in after if after[name] > before[name]]
    return worker, result.usage.cached_prompt_tokens


def indexed_blocks(client) -> dict[str, int | None]:
    return {w.worker_id: w.num_indexed_blocks for w in client.server_info().workers}


def wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_restarted_scheduler_resyncs_and_routes_prefix_aware_again(fleet):
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 250, (6 * BLOCK,), generator=g).tolist()

    def with_suffix(seed: int) -> list[int]:
        return (
            prefix
            + torch.randint(3, 250, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        )

    with GenerationClient(fleet.endpoint) as client:
        owner, cached = served_by(fleet, client, with_suffix(1))
        assert cached == 0
        wait_for(lambda: (indexed_blocks(client).get(owner) or 0) >= 6, "the owner's KV events")
        assert served_by(fleet, client, with_suffix(2)) == (owner, 6 * BLOCK)

    fleet.restart("router")  # SIGKILL: the new process starts with an empty KV view

    with GenerationClient(fleet.endpoint) as client:
        # Both workers registered again and each view was rebuilt from a snapshot (no event
        # has been published since the restart: the blocks can only come from snapshots).
        views = wait_for(
            lambda: (v := indexed_blocks(client)) and len(v) == 2 and None not in v.values() and v,
            "both workers' snapshots",
        )
        assert views[owner] >= 6
        assert all(n == 0 for w, n in views.items() if w != owner)
        for seed in (3, 4, 5):
            assert served_by(fleet, client, with_suffix(seed)) == (owner, 6 * BLOCK)
