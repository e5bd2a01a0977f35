"""Graceful drain of a real fleet (simulated workers): SIGTERM to a worker, the router or the
gateway while 50 streams are in flight. Every stream completes with all its tokens, the process
exits 0, and while it drains it is NOT_SERVING and refuses new requests (UNAVAILABLE / 503)."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal

import grpc
import pytest
from fault_fleet import (
    Streams,
    all_blocks_free,
    health,
    http_status,
    num_on_workers,
    sim_spec,
    wait_until,
    wait_until_async,
)
from grpc_health.v1 import health_pb2

from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient, ClientError
from llmfleet.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(120)

NUM_STREAMS = 50
MAX_TOKENS = 60
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _add_request(address: str) -> grpc.StatusCode:
    """The status a new AddRequest gets from the worker at `address`."""
    async with grpc.aio.insecure_channel(address) as ch:
        req = worker_pb2.AddRequestRequest(
            request_id="late",
            prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=4),
            reply_endpoint="tcp://127.0.0.1:9",
        )
        try:
            await worker_pb2_grpc.WorkerStub(ch).AddRequest(req, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two workers of 8 sequences at most (most of a worker's share waits in its queue) and a
    gateway; supervised, so each test's drained process is started again for the next."""
    spec = sim_spec(
        tmp_path_factory.mktemp("drain"),
        gateway=True,
        extra_args={"worker": ["--max-num-seqs", "8"]},
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture
def serving(fleet):
    """The fleet, once every child serves again."""
    for c in fleet.children:
        if c.kind == "gateway":
            wait_until(lambda: http_status(f"{fleet.http_url}/health") == 200, "gateway", 60)
        else:
            wait_until(lambda c=c: health(c.address) == SERVING, f"{c.name} SERVING", 60)
    return fleet


def test_sigterm_worker_finishes_its_streams_moves_its_queue_and_exits_0(serving):
    fleet = serving
    worker = fleet.child("worker-0")
    proc = worker.proc
    assert proc is not None

    async def scenario() -> tuple[list, grpc.StatusCode, int | None]:
        streams = Streams(fleet.endpoint, NUM_STREAMS, MAX_TOKENS)
        async with AsyncGenerationClient(fleet.endpoint) as client:
            task = asyncio.ensure_future(streams.run(client))
            await wait_until_async(
                lambda: streams.started >= 16, "streams running on the workers", 30
            )
            proc.send_signal(signal.SIGTERM)
            await wait_until_async(
                lambda: health(worker.address) != SERVING, "the worker NOT_SERVING", 10
            )
            await wait_until_async(  # the router has its drain notice
                lambda: "queued requests moved" in worker.log_path.read_text(), "the notice", 10
            )
            late = await _add_request(worker.address)
            status = health(worker.address)
            return await task, late, status

    results, late, status = asyncio.run(scenario())
    assert results == [(MAX_TOKENS, "length")] * NUM_STREAMS
    assert late is grpc.StatusCode.UNAVAILABLE
    assert status in (NOT_SERVING, None)  # None: it had already finished and exited
    assert proc.wait(timeout=30) == 0
    log = worker.log_path.read_text()
    moved = [line for line in log.splitlines() if "queued requests moved" in line]
    assert moved and not moved[0].split("drain: ")[1].startswith("0 ")
    # The fleet serves on (the supervisor starts the worker again) and nothing leaks.
    wait_until(lambda: fleet.num_restarts("worker-0") == 1, "worker-0 restarted")
    wait_until(lambda: all_blocks_free(fleet.worker_addresses), "all KV blocks free")


def test_sigterm_router_finishes_50_streams_refuses_new_ones_and_exits_0(serving):
    fleet = serving
    router = fleet.child("router")
    proc = router.proc
    assert proc is not None

    async def scenario() -> tuple[list, str]:
        streams = Streams(fleet.endpoint, NUM_STREAMS, MAX_TOKENS)
        async with AsyncGenerationClient(fleet.endpoint) as client:
            task = asyncio.ensure_future(streams.run(client))
            await wait_until_async(  # every stream is on a worker (running or queued)
                lambda: num_on_workers(fleet.worker_addresses) + streams.done == NUM_STREAMS,
                "every stream on a worker",
            )
            proc.send_signal(signal.SIGTERM)
            await wait_until_async(
                lambda: health(router.address) != SERVING, "the router NOT_SERVING", 10
            )
            try:
                await client.generate(token_ids=[5, 6, 7], max_tokens=4)
                late = "OK"
            except ClientError as exc:
                late = exc.code_name
            return await task, late

    results, late = asyncio.run(scenario())
    assert results == [(MAX_TOKENS, "length")] * NUM_STREAMS
    assert late == "UNAVAILABLE"
    assert proc.wait(timeout=30) == 0


def test_sigterm_gateway_finishes_open_streams_and_answers_503_meanwhile(serving):
    fleet = serving
    gateway = fleet.child("gateway")
    proc = gateway.proc
    assert proc is not None and fleet.http_url is not None
    host, port = gateway.address.rsplit(":", 1)
    conns = []
    for i in range(NUM_STREAMS // 5):  # streaming completions held open across the SIGTERM
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {
            "model": _model(fleet.http_url),
            "prompt": f"count to {i}",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        conn.request("POST", "/v1/completions", json.dumps(body), _JSON)
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()  # the first event: the stream is open
        conns.append((conn, resp))
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http_status(f"{fleet.http_url}/health") == 503, "health 503", 10)
    assert http_status(f"{fleet.http_url}/v1/models") == 503
    for conn, resp in conns:
        events = [line for line in resp.read().decode().split("\n") if line.strip()]
        conn.close()
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"
    assert proc.wait(timeout=30) == 0


_JSON = {"Content-Type": "application/json"}


def _model(base: str) -> str:
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return model


def test_stopping_the_fleet_drains_tier_by_tier_every_stream_completes(fleet):
    """Last: `Fleet.stop` (as `llmfleet up` on Ctrl-C) with 50 streams in flight. Every worker
    drains at once, so none can take another's queue: each finishes its own."""
    for c in fleet.children:
        if c.kind != "gateway":
            wait_until(lambda c=c: health(c.address) == SERVING, f"{c.name} SERVING", 60)

    async def scenario() -> list:
        streams = Streams(fleet.endpoint, NUM_STREAMS, MAX_TOKENS)
        async with AsyncGenerationClient(fleet.endpoint) as client:
            task = asyncio.ensure_future(streams.run(client))
            await wait_until_async(
                lambda: num_on_workers(fleet.worker_addresses) + streams.done == NUM_STREAMS,
                "every stream on a worker",
            )
            stopping = asyncio.get_running_loop().run_in_executor(None, fleet.stop)
            results = await task
            await stopping
            return results

    assert asyncio.run(scenario()) == [(MAX_TOKENS, "length")] * NUM_STREAMS
    assert set(fleet.exit_codes().values()) == {0}
