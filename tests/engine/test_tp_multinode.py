"""Tensor parallelism across machines, on one CPU (gloo over 127.0.0.1): a leader that runs one
of two ranks itself (`tp_local_ranks=1`) and a rank that joins it as a separate
`llmfleet worker --tp-join` process give the greedy tokens of TP=1; the joining rank exits 0
when the leader closes the group, and 1 with a clear message when the leader goes away."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.tp_ranks import CONFIG_KEY
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CFG = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, num_threads=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(port: int, rank: int = 1, size: int = 2) -> subprocess.Popen[str]:
    """`llmfleet worker --tp-join 127.0.0.1:PORT --tp-rank RANK` (it waits for the leader)."""
    argv = [sys.executable, "-m", "llmfleet.services.worker", "--tp-join", f"127.0.0.1:{port}"]
    argv += ["--tp-rank", str(rank), "--tensor-parallel-size", str(size), "--num-threads", "1"]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)


def leader_config(path, port: int) -> EngineConfig:
    return EngineConfig(
        model=str(path), tensor_parallel_size=2, tp_local_ranks=1, tp_port=port, **CFG
    )


def drain(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def test_a_rank_joining_from_another_process_gives_the_tp1_tokens(make_checkpoint_module):
    # 3 KV heads: the leader holds 2, the joining rank 1.
    path = make_checkpoint_module(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (23, 7)]
    one = EngineConfig(model=str(path), **CFG)
    want = drain(LLMEngine(one, load_for(one)), prompts)

    port = free_port()
    joiner = join(port)  # started first: it waits for the leader's rendezvous
    try:
        config = leader_config(path, port)
        leader = LLMEngine(config, load_for(config))
        assert leader.runner.ranks.procs == []  # no local follower: rank 1 joined
        assert drain(leader, prompts) == want
        leader.close()
        assert joiner.wait(timeout=10) == 0, joiner.stderr.read() if joiner.stderr else ""
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()


LEADER = """
import sys
from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
config = EngineConfig(**{config})
engine = LLMEngine(config, load_for(config))
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_joined_rank_exits_1_with_a_message_when_the_leader_goes_away(make_checkpoint_module):
    path = make_checkpoint_module("llama")
    port = free_port()
    fields = dict(model=str(path), tensor_parallel_size=2, tp_local_ranks=1, tp_port=port, **CFG)
    joiner = join(port)
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER.format(config=json.dumps(fields))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "ready"
        assert joiner.poll() is None  # serving with the leader
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        start = time.monotonic()
        assert joiner.wait(timeout=15) == 1
        assert time.monotonic() - start < 10
        assert joiner.stderr is not None
        assert "tensor-parallel leader at 127.0.0.1" in joiner.stderr.read()
    finally:
        for proc in (joiner, leader):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_joining_rank_of_another_group_size_exits_2(make_checkpoint_module):
    path = make_checkpoint_module("llama")
    port = free_port()
    joiner = join(port, rank=1, size=3)
    # The leader's rendezvous: a group of 2 ranks.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(leader_config(path, port))))
    try:
        assert joiner.wait(timeout=60) == 2
        assert joiner.stderr is not None
        assert "runs 2 ranks" in joiner.stderr.read()
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()


def test_a_second_process_joining_as_a_taken_rank_exits_2(make_checkpoint_module):
    """Two workers started with the same --tp-rank: the second is refused at once, with the
    reason, instead of both waiting on a group that can never form."""
    path = make_checkpoint_module("llama")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(leader_config(path, port))))
    first, second = join(port, rank=1), None
    try:
        deadline = time.monotonic() + 60
        while not store.check(["joined/1"]):  # the first has its rank
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = join(port, rank=1)
        assert second.wait(timeout=60) == 2
        assert second.stderr is not None and "rank 1 of this tensor-parallel group is taken" in (
            second.stderr.read()
        )
        assert first.poll() is None  # still waiting for its leader
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_group_flags_are_validated():
    bad = [
        ({"tp_local_ranks": 3}, "tp_local_ranks"),  # more than the group's 2 ranks
        ({"tp_local_ranks": 1}, "tp_port"),  # remote ranks need a port to join at
        ({"tp_join": "10.0.0.1:29500"}, "tp_join"),  # without its rank
        ({"tp_join": "10.0.0.1", "tp_rank": 1}, "tp_join"),  # no port
        ({"tp_join": "10.0.0.1:29500", "tp_rank": 2}, "tp_rank"),  # not in 1..1
        ({"tp_join": "10.0.0.1:29500", "tp_rank": 0}, "tp_rank"),  # rank 0 is the leader
        ({"tp_all_reduce": "custom"}, "tp_all_reduce"),  # auto or nccl
    ]
    for fields, name in bad:
        with pytest.raises(ValidationError) as e:
            EngineConfig(tensor_parallel_size=2, **fields)
        assert e.value.field == name, fields
    # A bad value is a usage error of `llmfleet worker` (exit 2), before anything starts.
    argv = [sys.executable, "-m", "llmfleet.services.worker", "--tp-join", "10.0.0.1:1"]
    argv += ["--tensor-parallel-size", "2", "--tp-rank", "5"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "tp_rank" in done.stderr
