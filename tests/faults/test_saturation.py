"""A short soak at saturation (benchmarks/soak.py): more streams than the workers run at once,
10% cancelled mid-stream, on a 2-core machine where every fleet process competes for the CPU.
No request fails but the cancelled ones, every KV block is free again, no fd leaks, and no
worker is dropped by the router (starved heartbeats must not look like a dead worker)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak  # noqa: E402

from llmfleet.cli.launcher import Fleet  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def test_saturated_fleet_with_cancels_fails_nothing_and_leaks_no_blocks(tmp_path, capsys):
    args = soak.build_parser().parse_args(
        ["--duration-s", "15", "--warmup-s", "2", "--concurrency", "48", "--max-num-seqs", "8"]
    )
    with Fleet(soak.fleet_spec(args, str(tmp_path / "logs"))) as fleet:
        result = soak.soak(fleet, args)
        router_log = fleet.child("router").log_path.read_text()
    tally = result.tally
    assert tally.failed == 0, tally.errors
    assert tally.completed > 100
    assert 0.05 < tally.cancelled / (tally.cancelled + tally.completed) < 0.2
    for name, after in result.after.items():
        before = result.before[name]
        assert after.free_blocks == after.total_blocks, name
        assert after.num_fds <= before.num_fds, name
    assert result.workers_seen == 2
    assert "removed" not in router_log  # no worker dropped, not even for a moment
    assert "KV blocks free" in capsys.readouterr().out
