"""`llmfleet up --tensor-parallel-size 2` on the CPU: the bundled model (9 query, 3 KV heads,
split 2 + 1 over two gloo ranks) served with the greedy tokens of the in-process TP=1 engine,
its prompt KV put into the kvstore (gathered from both ranks); the worker's follower rank
lives as long as the worker does. A worker whose second rank joins it from a separate
`llmfleet worker --tp-join` process (as from another machine) serves TP=1's tokens too."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fleet_helpers import WORKER_ARGS, reference_tokens, worker_stats

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.shared.core.sampling_params import SamplingParams


def followers_of(pid: int) -> list[int]:
    """Pids of the tensor-parallel follower ranks that worker `pid` started."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not a process
            continue
        if b"llmfleet.engine.tp_follower" in argv and str(pid).encode() in argv:
            found.append(int(proc.name))
    return found


def test_a_worker_whose_rank_1_joins_from_another_process_serves_the_tp1_tokens(
    make_checkpoint_module, tmp_path
):
    path = str(make_checkpoint_module("llama"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "rank1.log"
    argv = [sys.executable, "-m", "llmfleet.services.worker", "--tp-join", f"127.0.0.1:{port}"]
    argv += ["--tp-rank", "1", "--tensor-parallel-size", "2", "--num-threads", "1"]
    with log.open("w") as err:
        joiner = subprocess.Popen(argv, stderr=err)  # it waits for the leader
    spec = FleetSpec(
        port=0,
        model=path,
        engine={"tensor_parallel_size": 2, "tp_local_ranks": 1, "tp_port": port},
        extra_args={"worker": WORKER_ARGS},
        startup_timeout_s=120,
    )
    try:
        g = torch.Generator().manual_seed(1)
        ps = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 21)]
        ref = reference_tokens(
            path, ps, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        with Fleet(spec) as f:
            [worker] = f.workers
            assert worker.proc is not None and followers_of(worker.proc.pid) == []
            client = GenerationClient(f.endpoint)
            for i, p in enumerate(ps):
                res = client.generate(token_ids=p, max_tokens=6, temperature=0.0, ignore_eos=True)
                assert res.completions[0].token_ids == ref[i][0], i
            assert joiner.poll() is None
        assert joiner.wait(timeout=15) == 0, log.read_text()  # it left with its leader
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()


@pytest.fixture(scope="module")
def fleet():
    spec = FleetSpec(
        port=0,
        engine={"tensor_parallel_size": 2},
        extra_args={"worker": WORKER_ARGS},
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


def test_tp2_worker_serves_the_bundled_model_with_the_tp1_tokens(fleet):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (7, 29)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = reference_tokens(None, ps, params)  # the bundled model, one process
    client = GenerationClient(fleet.endpoint)
    for i, p in enumerate(ps):
        res = client.generate(token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert res.completions[0].token_ids == ref[i][0], i
    res = client.generate(prompt="The capital of France is", max_tokens=4, temperature=0.0)
    assert res.completions[0].text.strip()

    [worker] = fleet.workers
    # The 29-token prompt's full block was read from both ranks and put into the kvstore.
    deadline = time.monotonic() + 30
    while worker_stats(worker.address).kvstore_blocks_stored < 1:
        assert time.monotonic() < deadline, "no KV block reached the kvstore"
        time.sleep(0.05)
    assert worker.proc is not None
    [follower] = followers_of(worker.proc.pid)
    fleet.stop()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{follower}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{follower}").exists()  # it left with its worker
