"""A real disaggregated fleet on loopback: prefill and decode workers with the KV lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq
from fleet_helpers import (
    WORKER_ARGS,
    logged_endpoint,
    reference_tokens,
    wait_all_blocks_free,
    worker_stats,
)

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.shared.core.sampling_params import SamplingParams

SHORT = 16  # prompts shorter than this are prefilled by the decode worker itself


@pytest.fixture(scope="module")
def model(make_checkpoint_module) -> str:
    return str(make_checkpoint_module("qwen2", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def fleet(model):
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=model,
        extra_args={
            "worker": WORKER_ARGS,
            "router": ["--short-prompt-threshold", str(SHORT), "--max-retries", "1"],
        },
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return GenerationClient(fleet.endpoint)


def prompts(n_list, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in n_list]


def by_role(fleet, role):
    return [c.address for c in fleet.workers if c.role == role]


def test_handoff_greedy_equals_in_process_engine(model, client, fleet):
    ps = prompts([40, 70, 5])  # two through the lease, one short (decode prefills it)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = reference_tokens(model, ps, params)
    [prefill] = by_role(fleet, "prefill")
    queries0 = worker_stats(prefill).prefix_cache_queries
    for i, p in enumerate(ps):
        res = client.generate(token_ids=p, max_tokens=10, temperature=0.0, ignore_eos=True)
        assert res.completions[0].token_ids == ref[i][0], i
        streamed = [
            t
            for d in client.stream(token_ids=p, max_tokens=10, temperature=0.0, ignore_eos=True)
            for t in d.token_ids
        ]
        assert streamed == ref[i][0], i
    # The two long prompts (twice each) went through the prefill worker; the short one did not.
    assert worker_stats(prefill).prefix_cache_queries - queries0 == 2 * (40 + 70)
    for s in wait_all_blocks_free(fleet):
        assert s.load.num_free_blocks == s.load.num_total_blocks
        assert s.load.num_active_leases == 0


def test_n2_in_disaggregated_mode(model, client):
    [p] = prompts([30], seed=1)
    ref = reference_tokens(
        model, [p], SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    res = client.generate(token_ids=p, n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [c.token_ids for c in res.completions] == [ref[0][0], ref[0][1]]


def test_malformed_frames_on_decode_kv_endpoint_are_survived(client, fleet):
    decode = next(c for c in fleet.workers if c.role == "decode")
    endpoint = logged_endpoint(decode.log_path, "kv_endpoint=")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        for frames in ([b"\xff\xfe garbage"], [b""], [b"\x0a\x03abc", b"x" * 9]):
            sock.send_multipart(frames)
        sock.close()
    finally:
        ctx.term()
    time.sleep(0.5)
    [p] = prompts([50], seed=5)
    res = client.generate(token_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(res.completions[0].token_ids) == 4
    assert decode.proc is not None and decode.proc.poll() is None


def test_prefill_worker_killed_request_retried_cleanly(model, client, fleet):
    [p] = prompts([60], seed=2)
    ref = reference_tokens(
        model, [p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    prefill = next(c for c in fleet.workers if c.role == "prefill")
    assert prefill.proc is not None
    prefill.proc.send_signal(signal.SIGKILL)  # dies before any push
    prefill.proc.wait(timeout=10)
    res = client.generate(token_ids=p, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert res.completions[0].token_ids == ref[0][0]  # retried on the decode worker
    [decode] = by_role(fleet, "decode")
    deadline = time.monotonic() + 20
    while True:
        s = worker_stats(decode)
        if s.load.num_free_blocks == s.load.num_total_blocks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert s.load.num_free_blocks == s.load.num_total_blocks
    assert s.load.num_active_leases == 0


def test_llmfleet_up_serves_and_stops_on_sigint(model):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "llmfleet.cli.main", "up", "--port", "0", "--model", model,
           "--no-kvstore", "--no-gateway", "--quiet"]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert "serving on" in line, line + (up.stderr.read() if up.poll() is not None else "")
        endpoint = line.strip().split()[-1]
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmfleet.cli.main",
                "generate",
                "--endpoint",
                endpoint,
                "--raw",
                "--max-tokens",
                "5",
                "hello",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
