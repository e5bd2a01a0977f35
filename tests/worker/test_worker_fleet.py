"""A worker among its peers: registration with a (fake) router Registry, and the shared
kvstore (a prompt first served by worker A is found cached by worker B)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from worker_helpers import BS, Replies, add_request_pb, prompt, run, start_worker, stats, stub

from llmfleet.models.loader import load_model
from llmfleet.services.kvstore.server import serve as serve_kvstore
from llmfleet.services.worker.kvstore_client import KVStoreClient
from llmfleet.shared.core.config import KVStoreConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.transport import tensor_frame
from llmfleet.v1 import common_pb2, registry_pb2, registry_pb2_grpc


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    """Forgets the worker once after its first heartbeat, like a restarted router."""

    def __init__(self) -> None:
        self.registrations: list[registry_pb2.RegisterWorkerRequest] = []
        self.heartbeats = 0
        self.deregistered: list[tuple[str, bool]] = []  # (worker id, draining)
        self.forget_once = True

    async def RegisterWorker(self, request, context):
        self.registrations.append(request)
        return registry_pb2.RegisterWorkerResponse(heartbeat_interval_ms=20)

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        known = not self.forget_once
        self.forget_once = False
        return registry_pb2.HeartbeatResponse(known=known)

    async def DeregisterWorker(self, request, context):
        self.deregistered.append((request.worker_id, request.draining))
        return registry_pb2.DeregisterWorkerResponse()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def health_status(address: str) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(address))
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    return resp.status


def test_registers_heartbeats_and_reregisters_when_forgotten(loaded):
    async def body():
        port = free_port()
        w = await start_worker(
            loaded, role="decode", worker_id="w-1", router_address=f"127.0.0.1:{port}"
        )
        registry = FakeRegistry()
        server = grpc.aio.server()
        try:
            await asyncio.sleep(0.3)  # router down: the worker keeps serving, NOT_SERVING
            assert await health_status(w.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            while len(registry.registrations) < 2 or registry.heartbeats < 3:
                await asyncio.sleep(0.02)
            first = registry.registrations[0]
            assert first.worker_id == "w-1"
            assert first.role == common_pb2.WORKER_ROLE_DECODE
            assert first.address == w.address
            assert first.kv_events_endpoint == w.kv_events_endpoint
            assert first.model.model_id == loaded.spec.model_id
            assert first.model.vocab_size == loaded.spec.vocab_size
            assert first.model.block_size == BS
            assert first.load.num_total_blocks == 64
            assert await health_status(w.address) == health_pb2.HealthCheckResponse.SERVING
        finally:
            await w.stop()
            await server.stop(0)
        # The drain notice (no new requests; nothing was queued), then leaving the pool.
        assert registry.deregistered == [("w-1", True), ("w-1", False)]

    run(body())


async def _stop(ctx, replies, kv, *workers) -> None:
    """Tear down what a kvstore test started: reply socket, workers, kvstore, ZMQ context."""
    replies.close()
    for w in workers:
        await w.stop()
    await kv.stop(0)
    ctx.destroy(linger=0)


def test_worker_b_finds_the_prompt_worker_a_put_in_the_kvstore(loaded):
    ids = prompt(loaded, 21, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def body():
        ctx = zmq.asyncio.Context()
        kv = await serve_kvstore(KVStoreConfig(ram_bytes=64 << 20))
        kw = dict(kvstore_address=kv.address, kvstore_endpoint=kv.data_endpoint)
        a = await start_worker(loaded, **kw)
        b = await start_worker(loaded, **kw)
        replies = Replies(ctx)
        try:
            ra = await stub(a).AddRequest(add_request_pb("x", ids, params, replies.endpoint))
            assert ra.num_cached_tokens == 0
            [ca] = await replies.until_finished("x")
            await _until(lambda st: st.kvstore_blocks_stored == 5, a)  # 21 tokens: 5 blocks

            rb = await stub(b).AddRequest(add_request_pb("y", ids, params, replies.endpoint))
            assert rb.num_cached_tokens == 20
            [cb] = await replies.until_finished("y")
            assert cb.tokens == ca.tokens
            assert cb.num_cached_tokens == 20
            st = await stats(b)
            assert st.kvstore_blocks_fetched == 5
            assert st.kvstore_blocks_stored == 0  # the kvstore had every full block already
            # the fetch was timed, for the router's scorer; a never fetched nothing
            assert st.load.fetch_seconds_per_token > 0
            assert (await stats(a)).load.fetch_seconds_per_token == 0
        finally:
            await _stop(ctx, replies, kv, a, b)

    run(body())


def test_blocks_evicted_between_lookup_and_get_are_computed_instead(loaded):
    """The kvstore evicts the chain its lookup reported before the get: the get returns no
    block, and the request runs as if the store held none (no error, the same tokens)."""
    ids = prompt(loaded, 21, seed=13)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def body():
        ctx = zmq.asyncio.Context()
        a = await start_worker(loaded)
        block = a.engine.kv.block_shape
        block_bytes = math.prod(block) * a.engine.kv.dtype.itemsize
        kv = await serve_kvstore(KVStoreConfig(ram_bytes=8 * block_bytes))  # room for 8 blocks
        kw = dict(kvstore_address=kv.address, kvstore_endpoint=kv.data_endpoint)
        b = await start_worker(loaded, **kw)
        replies = Replies(ctx)
        other = KVStoreClient(kv.address, kv.data_endpoint, ctx=ctx)
        try:
            ra = await stub(a).AddRequest(add_request_pb("x", ids, params, replies.endpoint))
            [ca] = await replies.until_finished("x")
            chain = a.engine.kv.cached_block_hashes()[:5]
            payload = a.engine.kv.start_export("test", chain).wait()
            a.engine.kv.end_export("test")
            await other.put(b.kv_layout_key, chain, [tensor_frame(p) for p in payload])
            assert await other.lookup(b.kv_layout_key, chain) == 5
            lookup = b.kvstore.client.lookup

            async def lookup_then_evict(layout, hashes):
                found = await lookup(layout, hashes)
                filler = [bytes([i]) * 32 for i in range(8)]  # 8 other blocks evict the chain
                await other.put(
                    layout, filler, [tensor_frame(p) for p in payload[:1].repeat(8, 1, 1, 1, 1, 1)]
                )
                return found

            b.kvstore.client.lookup = lookup_then_evict
            rb = await stub(b).AddRequest(add_request_pb("y", ids, params, replies.endpoint))
            assert (ra.num_cached_tokens, rb.num_cached_tokens) == (0, 0)
            [cb] = await replies.until_finished("y")
            assert cb.tokens == ca.tokens
            assert (await stats(b)).kvstore_blocks_fetched == 0
        finally:
            await other.close()
            await _stop(ctx, replies, kv, a, b)

    run(body())


async def _until(cond, *servers, timeout_s: float = 20.0):
    """Poll the servers' stats until `cond(stats)` holds for each; returns the last stats."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = [await stats(s) for s in servers]
        if all(cond(st) for st in got):
            return got
        assert loop.time() < deadline, f"condition never held: {got}"
        await asyncio.sleep(0.02)


def test_view_of_the_kvstore_skips_lookups_and_puts_wait_their_delay(loaded):
    """With the kvstore's event endpoint a worker skips the lookup RPC for a prompt the store
    holds none of, yet still fetches what another worker put; puts start after their delay."""
    ids = prompt(loaded, 21, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def body():
        ctx = zmq.asyncio.Context()
        kv = await serve_kvstore(KVStoreConfig(ram_bytes=64 << 20))
        kw = dict(
            kvstore_address=kv.address,
            kvstore_endpoint=kv.data_endpoint,
            kvstore_events_endpoint=kv.events_endpoint,
        )
        a = await start_worker(loaded, kvstore_put_delay_ms=1500, **kw)
        b = await start_worker(loaded, kvstore_put_delay_ms=0, **kw)
        replies = Replies(ctx)
        try:
            # Both views resynced from a snapshot of the empty store.
            await _until(lambda st: st.HasField("kvstore_view_blocks"), a, b)
            ra = await stub(a).AddRequest(add_request_pb("x", ids, params, replies.endpoint))
            assert ra.num_cached_tokens == 0
            [ca] = await replies.until_finished("x")
            st = await stats(a)
            assert st.kvstore_lookups_skipped == 1  # the view held none of the chain
            assert st.kvstore_blocks_stored == 0  # the put waits out its 1.5 s
            # Then it lands, and the store's stored events reach b's view.
            await _until(lambda st: st.kvstore_blocks_stored == 5, a)
            await _until(lambda st: st.kvstore_view_blocks == 5, a, b)

            rb = await stub(b).AddRequest(add_request_pb("y", ids, params, replies.endpoint))
            assert rb.num_cached_tokens == 20
            [cb] = await replies.until_finished("y")
            assert cb.tokens == ca.tokens
            st = await stats(b)
            assert st.kvstore_lookups_skipped == 0  # the view held the chain: looked up
            assert st.kvstore_blocks_fetched == 5
        finally:
            await _stop(ctx, replies, kv, a, b)

    run(body())


def test_view_of_a_restarted_kvstore_resyncs_to_the_new_store(loaded):
    """A kvstore restarted on the same addresses starts empty with its event seq from 1 again:
    the worker's view must follow the new store (its epoch differs), not keep the old set."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    config = KVStoreConfig(
        ram_bytes=64 << 20, port=free_port(), data_port=free_port(), events_port=free_port()
    )

    async def body():
        ctx = zmq.asyncio.Context()
        kv = await serve_kvstore(config)
        kw = dict(
            kvstore_address=kv.address,
            kvstore_endpoint=kv.data_endpoint,
            kvstore_events_endpoint=kv.events_endpoint,
        )
        a = await start_worker(loaded, kvstore_put_delay_ms=0, **kw)
        replies = Replies(ctx)

        async def generate(rid: str, num_tokens: int, seed: int) -> None:
            ids = prompt(loaded, num_tokens, seed=seed)
            await stub(a).AddRequest(add_request_pb(rid, ids, params, replies.endpoint))
            await replies.until_finished(rid)

        try:
            await _until(lambda st: st.HasField("kvstore_view_blocks"), a)
            await generate("x", 21, seed=21)  # puts 5 blocks: the old store's event seq 1
            await _until(lambda st: st.kvstore_view_blocks == 5, a)

            await kv.stop(0)
            kv = await serve_kvstore(config)  # empty; its first event is seq 1 again
            # PUB/SUB drops events published before the view's socket reconnects, so put 3
            # more blocks at a time until the view follows the new store: its set must be
            # exactly the new store's (without epochs it kept x's 5 and added to them).
            followed = False
            for i in range(10):
                await generate(f"y{i}", 13, seed=100 + i)  # 3 full blocks each
                new_blocks = 3 * (i + 1)
                await _until(lambda st, n=new_blocks: st.kvstore_blocks_stored == 5 + n, a)
                try:
                    await _until(
                        lambda st, n=new_blocks: st.kvstore_view_blocks == n, a, timeout_s=2.0
                    )
                except AssertionError:
                    continue
                followed = True
                break
            assert followed, await stats(a)
        finally:
            await _stop(ctx, replies, kv, a)

    run(body())


def test_cli_serves_and_exits_zero_on_sigterm(make_checkpoint_module):
    ckpt = make_checkpoint_module("llama")
    cmd = [
        sys.executable, "-m", "llmfleet.services.worker", "--model", str(ckpt), "--port", "0",
        "--block-size", "4", "--num-kv-blocks", "32", "--role", "decode", "--grace-s", "1",
    ]  # fmt: skip
    env = {**os.environ, "LLMFLEET_WORKER_LEASE_TTL_MS": "5000"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line and "kv_endpoint=tcp://" in line:
                break
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is None
    finally:
        if proc.poll() is None:
            proc.kill()
