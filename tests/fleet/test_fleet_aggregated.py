"""A real aggregated fleet on loopback: kvstore, tokenizer, router, two unified workers."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
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
from llmfleet.client.generation import ClientError, GenerationClient
from llmfleet.shared.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(make_checkpoint_module) -> str:
    # A long context so that cancellation tests can run long requests.
    return str(make_checkpoint_module("llama", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def fleet(model):
    spec = FleetSpec(
        port=0,
        workers=2,
        model=model,
        routing_policy="round_robin",  # alternate workers: the kvstore test needs both
        extra_args={"worker": [*WORKER_ARGS, "--max-num-seqs", "2"]},
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return GenerationClient(fleet.endpoint)


def arg_value(child, flag: str) -> str:
    return child.argv[child.argv.index(flag) + 1]


def prompts(n_list, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in n_list]


def test_greedy_equals_in_process_engine_streaming_and_not(model, client, fleet):
    ps = prompts([5, 23, 40])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = reference_tokens(model, ps, params)
    for i, p in enumerate(ps):
        res = client.generate(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert res.completions[0].token_ids == ref[i][0]
        assert res.completions[0].finish_reason == "length"
        assert res.usage.prompt_tokens == len(p) and res.usage.completion_tokens == 12
        streamed: list[int] = []
        for d in client.stream(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True):
            streamed.extend(d.token_ids)
        assert streamed == ref[i][0]
    assert len(client.server_info().workers) == 2


def test_n2_greedy_equals_in_process_engine(model, client):
    [p] = prompts([17], seed=1)
    ref = reference_tokens(
        model, [p], SamplingParams(n=2, max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    res = client.generate(token_ids=p, n=2, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [c.token_ids for c in res.completions] == [ref[0][0], ref[0][1]]


def test_kv_reuse_across_workers_through_kvstore(client, fleet):
    [p] = prompts([100], seed=2)
    first = client.generate(token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True)
    # Puts are background work (they start kvstore_put_delay_ms after the first token): wait
    # until the six full blocks are stored and every worker's view of the kvstore has them.
    deadline = time.monotonic() + 30
    while True:
        stats = [worker_stats(a) for a in fleet.worker_addresses]
        stored = sum(s.kvstore_blocks_stored for s in stats)
        if stored >= 6 and all(s.kvstore_view_blocks >= 6 for s in stats):
            break
        assert time.monotonic() < deadline, f"kvstore puts or views not in: {stats}"
        time.sleep(0.05)
    second = client.generate(token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert first.usage.cached_prompt_tokens == 0
    # The first admission skipped the lookup: the views showed an empty kvstore.
    assert sum(s.kvstore_lookups_skipped for s in stats) >= 1
    # Round robin sent the second request to the other worker: it fetched the prompt's
    # six full blocks (96 tokens) from the kvstore instead of computing them.
    assert second.usage.cached_prompt_tokens == 96
    assert second.completions[0].token_ids == first.completions[0].token_ids
    fetched = [worker_stats(a).kvstore_blocks_fetched for a in fleet.worker_addresses]
    assert max(fetched) >= 6


def test_cancellation_mid_stream_and_in_queue_frees_blocks(client, fleet):
    # Six long requests over two workers that run at most two sequences each: some queue.
    streams = [
        client.stream(
            token_ids=p,
            max_tokens=1500,
            temperature=0.0,
            ignore_eos=True,
            request_id=f"cancel-{i}",
        )
        for i, p in enumerate(prompts([30] * 6, seed=3))
    ]
    iters = [iter(s) for s in streams]
    next(iters[0])  # the first is streaming
    deadline = time.monotonic() + 30
    while True:
        stats = [worker_stats(a) for a in fleet.worker_addresses]
        if sum(s.load.num_waiting for s in stats) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(s.load.num_running for s in stats) > 0
    assert sum(s.load.num_waiting for s in stats) > 0  # queued at the workers
    assert client.abort("cancel-5")  # the Abort RPC, for one of them
    deltas = list(iters[5])
    assert deltas and deltas[-1].finish_reason == "abort"
    for s in streams[:5]:
        s.close()  # client-side cancellation of the rest, mid-stream or queued
    stats = wait_all_blocks_free(fleet)
    for s in stats:
        assert s.load.num_running == 0 and s.load.num_waiting == 0
        assert s.load.num_free_blocks == s.load.num_total_blocks


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(token_ids=[1, 2], temperature=3.0), "sampling.temperature"),
        (dict(token_ids=[1, 2], top_p=0.0), "sampling.top_p"),
        (dict(token_ids=[1, 2], max_tokens=10**6), "sampling.max_tokens"),
        (dict(token_ids=[1, 10**6]), "tokens.token_ids"),
        (dict(token_ids=[1, -5]), "tokens.token_ids"),
        (dict(prompt="", raw=True), "text"),
        (dict(token_ids=[1, 2], n=1000), "sampling.n"),
        (dict(token_ids=[1, 2], logprobs=1000), "sampling.logprobs"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(ClientError) as e:
        client.generate(**kwargs)
    assert e.value.code_name == grpc.StatusCode.INVALID_ARGUMENT.name
    assert field in e.value.message


def test_malformed_frames_on_every_data_plane_socket_are_survived(client, fleet):
    targets = {
        "router replies": (
            logged_endpoint(fleet.child("router").log_path, "replies on"),
            zmq.PUSH,
        ),
        "kvstore data": (
            f"tcp://127.0.0.1:{arg_value(fleet.child('kvstore'), '--data-port')}",
            zmq.DEALER,
        ),
    }
    ctx = zmq.Context()
    try:
        for endpoint, kind in targets.values():
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            for frames in ([b"\xff\xfe garbage"], [b""], [b"\x08\x01", b"x" * 7, b"y"]):
                sock.send_multipart(frames)
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.5)
    [p] = prompts([20], seed=4)
    res = client.generate(token_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(res.completions[0].token_ids) == 4
    assert all(c.proc is not None and c.proc.poll() is None for c in fleet.children)


def test_up_with_chat_serves_a_conversation_then_stops(model):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmfleet.cli.main",
            "up",
            "--port",
            "0",
            "--model",
            model,
            "--no-kvstore",
            "--no-gateway",
            "--quiet",
            "--chat",
            "--max-tokens",
            "4",
        ],  # fmt: skip
        input="hello\nand again\n\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("llmfleet: serving on")
    assert len(lines) == 3  # the serving line, then one reply line per user turn
