"""In-process worker servicers over loopback gRPC and ZMQ: the aggregated path, cancellation,
KV events, validation errors and health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from worker_helpers import (
    BS,
    Replies,
    add_request_pb,
    prompt,
    reference_tokens,
    run,
    start_worker,
    stats,
    stub,
)

from llmfleet.models.loader import load_model
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.v1 import common_pb2, dataplane_pb2, worker_pb2

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def test_add_request_streams_the_engine_tokens(loaded):
    ids = prompt(loaded, 13)
    n2 = SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)
    ref, ref2 = reference_tokens(loaded, ids, GREEDY), reference_tokens(loaded, ids, n2)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        try:
            health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(w.address))
            h = await health.Check(health_pb2.HealthCheckRequest(service="llmfleet.v1.Worker"))
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            s = stub(w)
            step_count = {"model_name": loaded.spec.model_id}
            steps0 = REGISTRY.get_sample_value("llmfleet:engine_step_seconds_count", step_count)
            resp = await s.AddRequest(add_request_pb("r1", ids, GREEDY, replies.endpoint))
            assert resp.num_cached_tokens == 0
            [c] = await replies.until_finished("r1")
            assert c.tokens == ref[0]
            assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert replies.batches[0].worker_id == w.worker_id
            assert replies.batches[0].outputs[0].num_prompt_tokens == 13
            steps1 = REGISTRY.get_sample_value("llmfleet:engine_step_seconds_count", step_count)
            assert steps1 - (steps0 or 0) >= len(ref[0])  # one step per generated token at least

            resp = await s.AddRequest(add_request_pb("r2", ids, n2, replies.endpoint))
            assert resp.num_cached_tokens == 12  # r1's three full prompt blocks
            c0, c1 = await replies.until_finished("r2", n=2)
            assert [c0.tokens, c1.tokens] == [ref2[0], ref2[1]]
            # A prompt of its own, 48 uncached tokens: a prefill step whose cost stands out of
            # the decode base however busy the machine (r2 prefilled one token).
            fresh = prompt(loaded, 48, seed=1)
            await s.AddRequest(add_request_pb("r3", fresh, GREEDY, replies.endpoint))
            [c3] = await replies.until_finished("r3")
            assert c3.tokens == reference_tokens(loaded, fresh, GREEDY)[0]

            st = await stats(w)
            assert st.load.num_free_blocks == st.load.num_total_blocks == 64
            assert st.load.num_running == st.load.num_waiting == 0
            assert st.prefix_cache_hits >= 12
            # its own steps measured, for the router's scorer; nothing left to prefill
            assert st.load.step_seconds > 0 and st.load.prefill_seconds_per_token > 0
            assert st.load.num_queued_prompt_tokens == 0
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    run(body())


def test_validation_and_capacity_errors_have_status_codes(loaded):
    async def body():
        w = await start_worker(loaded, engine_kw=dict(num_kv_blocks=16))
        try:
            s = stub(w)
            ep = "tcp://127.0.0.1:1"
            cases = [
                (add_request_pb("a", [loaded.spec.vocab_size], GREEDY, ep), "prompt_token_ids"),
                (add_request_pb("a", [1, 2], GREEDY, ""), "reply_endpoint"),
                (add_request_pb("", [1, 2], GREEDY, ep), "request_id"),
            ]
            bad = add_request_pb("a", [1, 2], GREEDY, ep)
            bad.sampling.temperature = 5.0
            cases.append((bad, "sampling.temperature"))
            for req, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await s.AddRequest(req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in e.value.details()
            big = SamplingParams(max_tokens=40, temperature=0.0)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.AddRequest(add_request_pb("a", prompt(loaded, 40), big, ep))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # no retry would help
            assert "max_tokens" in e.value.details()
            # a unified worker has no role restriction; a prefill-only RPC on it without a
            # lease is a validation error
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.Prefill(worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=[1]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await w.stop()

    run(body())


def test_cancel_mid_stream_frees_every_block(loaded):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        try:
            s = stub(w)
            await s.AddRequest(add_request_pb("c", prompt(loaded, 9), long, replies.endpoint))
            n2 = SamplingParams(n=2, max_tokens=200, temperature=0.0, ignore_eos=True)
            await s.AddRequest(add_request_pb("d", prompt(loaded, 9), n2, replies.endpoint))
            while len(replies.completions[("c", 0)].tokens) < 3:
                await replies.next_batch()
            assert (await s.Cancel(worker_pb2.CancelRequest(request_id="c"))).found
            [c] = await replies.until_finished("c")
            assert c.finish_reason == common_pb2.FINISH_REASON_ABORT
            assert len(c.tokens) < 200
            # one completion stopped upstream by a stop string, the other aborted
            stop = worker_pb2.CancelRequest(
                request_id="d", index=0, reason=common_pb2.FINISH_REASON_STOP, stop_string="x"
            )
            assert (await s.Cancel(stop)).found
            assert (await s.Cancel(worker_pb2.CancelRequest(request_id="d", index=1))).found
            assert not (await s.Cancel(worker_pb2.CancelRequest(request_id="nope"))).found
            for _ in range(100):
                st = await stats(w)
                if st.load.num_running == 0 and st.load.num_free_blocks == 64:
                    break
                await asyncio.sleep(0.02)
            assert st.load.num_free_blocks == st.load.num_total_blocks
            assert st.load.num_running == st.load.num_waiting == 0
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    run(body())


def test_kv_events_are_consecutive_and_match_the_snapshot(loaded):
    ids = prompt(loaded, 17, seed=3)
    hashes = hash_block_chain(ids, BS, HashContext(model_id=loaded.spec.model_id, cache_salt="s"))

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.kv_events_endpoint)
        try:
            await asyncio.sleep(0.3)  # let the subscription reach the publisher
            s = stub(w)
            await s.AddRequest(add_request_pb("e", ids, GREEDY, replies.endpoint, salt="s"))
            await replies.until_finished("e")
            events: list[dataplane_pb2.KVEventBatch] = []
            held: set[bytes] = set()
            while True:
                try:
                    raw = await asyncio.wait_for(sub.recv(), 0.5)
                except TimeoutError:
                    break
                ev = dataplane_pb2.KVEventBatch.FromString(raw)
                events.append(ev)
                held.difference_update(ev.removed)
                held.update(ev.stored)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            assert all(e.publisher_id == w.worker_id for e in events)
            assert set(hashes) <= held  # the prompt's 4 full blocks (and generated ones)
            assert set(events[0].stored) == set(hashes)  # the prompt was one chunk
            snap = await s.GetKVSnapshot(worker_pb2.GetKVSnapshotRequest())
            assert snap.seq == events[-1].seq
            assert set(snap.block_hashes) == held
            assert snap.publisher_id == w.worker_id
        finally:
            sub.close(linger=0)
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    run(body())


def test_engine_work_runs_on_the_one_engine_thread(loaded, monkeypatch):
    """Every engine method (construction, admission, steps, cancels) runs on the worker's
    engine thread, never on the event loop's: torch work on a second thread makes OpenMP
    throttle its spin-waits for the whole process (loop.py)."""
    import threading

    from llmfleet.engine.engine import LLMEngine
    from llmfleet.services.worker.outputs import ReplySinks

    threads: dict[str, set[int]] = {}
    for name in ("__init__", "validate_request", "add_request", "step", "cancel"):
        original = getattr(LLMEngine, name)

        def recorded(self, *a, _name=name, _original=original, **kw):
            threads.setdefault(_name, set()).add(threading.get_ident())
            return _original(self, *a, **kw)

        monkeypatch.setattr(LLMEngine, name, recorded)
    # Token pushes leave from the engine thread too, right after their step (outputs.py).
    push = ReplySinks.send

    def recorded_push(self, *a, **kw):
        threads.setdefault("push", set()).add(threading.get_ident())
        return push(self, *a, **kw)

    monkeypatch.setattr(ReplySinks, "send", recorded_push)
    ids = prompt(loaded, 9)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)
        replies = Replies(ctx)
        try:
            s = stub(w)
            await s.AddRequest(add_request_pb("t1", ids, GREEDY, replies.endpoint))
            await replies.until_finished("t1")
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            await s.AddRequest(add_request_pb("t2", ids, long, replies.endpoint))
            await s.Cancel(worker_pb2.CancelRequest(request_id="t2"))
            return w.engine_thread.ident
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    engine_thread = run(body())
    assert engine_thread is not None and engine_thread != threading.get_ident()
    assert set(threads) == {"__init__", "validate_request", "add_request", "step", "cancel", "push"}
    assert all(idents == {engine_thread} for idents in threads.values()), threads


def test_cpu_worker_yields_after_a_first_token_only(loaded, monkeypatch):
    """After the step that gave a request its first token, the next step starts
    first_token_yield_ms later (the cores go to the services carrying that token); other
    steps follow at once, and the tokens are the engine's."""
    import time

    from llmfleet.engine.engine import LLMEngine

    steps: list[tuple[float, float]] = []
    original = LLMEngine.step

    def timed(self):
        start = time.perf_counter()
        try:
            return original(self)
        finally:
            steps.append((start, time.perf_counter()))

    monkeypatch.setattr(LLMEngine, "step", timed)
    ids = prompt(loaded, 11)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = reference_tokens(loaded, ids, params)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded, first_token_yield_ms=250)
        replies = Replies(ctx)
        try:
            steps.clear()
            await stub(w).AddRequest(add_request_pb("y1", ids, params, replies.endpoint))
            [c] = await replies.until_finished("y1")
            return c.tokens
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    assert run(body()) == ref[0]
    assert len(steps) == 6  # one prefill, five decode steps
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    assert gaps[0] >= 0.25, gaps
    assert max(gaps[1:]) < 0.25, gaps


def test_first_token_yield_flag_and_its_bounds():
    from llmfleet.services.worker.__main__ import parse_config
    from llmfleet.shared.core.config import WorkerConfig
    from llmfleet.shared.core.errors import ValidationError

    worker, _, _ = parse_config(["--first-token-yield-ms", "2.5"])
    assert worker.first_token_yield_ms == 2.5
    assert parse_config([])[0].first_token_yield_ms == 4.0
    for bad in (-1.0, 1001.0):
        with pytest.raises(ValidationError) as err:
            WorkerConfig(first_token_yield_ms=bad)
        assert err.value.field == "first_token_yield_ms"
