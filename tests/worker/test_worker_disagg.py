"""The disaggregated handoff between two in-process workers (prefill P, decode D), and its
faults: dead peers on either side, expiry, stale epochs, duplicated/late acks, bad frames."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from worker_helpers import Replies, prompt, reference_tokens, run, start_worker, stats, stub

from llmfleet.models.loader import load_model
from llmfleet.shared.core.host import host_id
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import sampling_to_pb
from llmfleet.shared.wire.transport import decode, encode
from llmfleet.v1 import common_pb2, dataplane_pb2, worker_pb2

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def prefill_pb(rid, ids, lease, params=PARAMS) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling=sampling_to_pb(params), lease=lease
    )


def start_decode_pb(rid, ids, lease, first, endpoint, params=PARAMS):
    return worker_pb2.StartDecodeRequest(
        lease_id=lease.lease_id,
        epoch=lease.epoch,
        request_id=rid,
        prompt_token_ids=ids,
        first_token_id=first,
        sampling=sampling_to_pb(params),
        reply_endpoint=endpoint,
    )


async def wait_free(server, expected: int) -> worker_pb2.GetWorkerStatsResponse:
    for _ in range(200):
        st = await stats(server)
        if st.load.num_free_blocks == expected:
            return st
        await asyncio.sleep(0.02)
    return st


def test_reserve_prefill_start_decode_gives_the_unified_tokens(loaded):
    ids = prompt(loaded, 22, seed=4)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)

    async def body():
        ctx = zmq.asyncio.Context()
        p = await start_worker(loaded, role="prefill")
        d = await start_worker(loaded, role="decode")
        replies = Replies(ctx)
        try:
            for i, params in enumerate((PARAMS, seeded)):
                ref = reference_tokens(loaded, ids, params)[0]
                rid = f"r{i}"
                res = await stub(d).ReserveKV(
                    worker_pb2.ReserveKVRequest(request_id=rid, num_prompt_tokens=len(ids))
                )
                lease = res.lease
                assert lease.num_blocks == 6 and lease.kv_endpoint == d.kv_endpoint
                assert lease.expires_at_unix_ms > time.time() * 1000
                assert (await stats(d)).load.num_active_leases == 1
                pre = await stub(p).Prefill(prefill_pb(rid, ids, lease, params))
                assert pre.first_token_id == ref[0]
                assert pre.kv_bytes > 0 and not pre.finished
                assert pre.HasField("first_logprobs") == (params.logprobs is not None)
                sd = start_decode_pb(rid, ids, lease, pre.first_token_id, replies.endpoint, params)
                await stub(d).StartDecode(sd)
                [c] = await replies.until_finished(rid)
                assert [pre.first_token_id, *c.tokens] == ref
                # a second StartDecode for the committed lease is refused
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub(d).StartDecode(sd)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert pre.num_cached_tokens == 20  # the second prefill hit P's prefix cache
            st_d, st_p = await wait_free(d, 64), await wait_free(p, 64)
            assert st_d.load.num_free_blocks == 64 and st_d.load.num_active_leases == 0
            assert st_p.load.num_free_blocks == 64
            # Both pushes went through host memory (CPU workers), and are counted.
            assert (st_p.kv_pushes_host, st_p.kv_pushes_gpu) == (2, 0)
            assert st_p.kv_pushed_bytes == 2 * pre.kv_bytes and st_p.kv_push_us > 0
        finally:
            replies.close()
            await p.stop()
            await d.stop()
            ctx.destroy(linger=0)

    run(body())


def test_dead_prefill_worker_lease_released_or_expired(loaded):
    ids = prompt(loaded, 10, seed=5)

    async def body():
        p = await start_worker(loaded, role="prefill")
        d = await start_worker(loaded, role="decode")
        try:
            await p.stop()  # the prefill worker dies before it pushes anything
            reserve = worker_pb2.ReserveKVRequest(request_id="a", num_prompt_tokens=len(ids))
            lease = (await stub(d).ReserveKV(reserve)).lease
            assert (await stats(d)).load.num_free_blocks == 64 - 3
            rel = worker_pb2.ReleaseKVRequest(lease_id=lease.lease_id, epoch=lease.epoch)
            assert (await stub(d).ReleaseKV(rel)).released
            assert not (await stub(d).ReleaseKV(rel)).released
            assert (await stats(d)).load.num_free_blocks == 64

            reserve = worker_pb2.ReserveKVRequest(request_id="b", num_prompt_tokens=10, ttl_ms=150)
            lease = (await stub(d).ReserveKV(reserve)).lease
            await asyncio.sleep(0.4)  # the sweeper expires it
            st = await wait_free(d, 64)
            assert st.load.num_free_blocks == 64 and st.load.num_active_leases == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(d).StartDecode(start_decode_pb("b", ids, lease, 1, "tcp://127.0.0.1:1"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "expired" in e.value.details()
            # capacity: more than the free blocks
            held = worker_pb2.ReserveKVRequest(request_id="c", num_prompt_tokens=40)
            lease = (await stub(d).ReserveKV(held)).lease
            big = worker_pb2.ReserveKVRequest(request_id="d", num_prompt_tokens=255)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(d).ReserveKV(big)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            rel = worker_pb2.ReleaseKVRequest(lease_id=lease.lease_id, epoch=lease.epoch)
            assert (await stub(d).ReleaseKV(rel)).released
            assert (await stats(d)).load.num_free_blocks == 64
        finally:
            await d.stop()

    run(body())


def test_dead_decode_worker_fails_the_prefill_within_the_timeout(loaded):
    ids = prompt(loaded, 10, seed=6)

    async def body():
        p = await start_worker(loaded, role="prefill", kv_push_timeout_ms=500)
        d = await start_worker(loaded, role="decode")
        try:
            reserve = worker_pb2.ReserveKVRequest(request_id="a", num_prompt_tokens=len(ids))
            lease = (await stub(d).ReserveKV(reserve)).lease
            await d.stop()
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(p).Prefill(prefill_pb("a", ids, lease))
            assert e.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            assert time.monotonic() - t0 < 5.0
            assert (await wait_free(p, 64)).load.num_free_blocks == 64
        finally:
            await p.stop()

    run(body())


async def fake_decode(ctx, log: list, behaviour: str):
    """A ROUTER that answers each push with noise around the real ack."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    previous: list[dataplane_pb2.KVTransferAck] = []

    async def serve_forever():
        while True:
            identity, *frames = await sock.recv_multipart()
            header, payload = decode(frames, dataplane_pb2.KVTransferHeader)
            log.append((header, len(payload)))
            ok = dataplane_pb2.KVTransferAck(
                lease_id=header.lease_id,
                epoch=header.epoch,
                transfer_id=header.transfer_id,
                ok=True,
            )
            noise = [
                dataplane_pb2.KVTransferAck(
                    lease_id=header.lease_id, epoch=header.epoch, transfer_id="stray", ok=False
                ),
                dataplane_pb2.KVTransferAck(
                    lease_id=header.lease_id,
                    epoch=header.epoch + 1,
                    transfer_id=header.transfer_id,
                    ok=False,
                ),
                *previous,  # late acks of earlier pushes
            ]
            for ack in noise:
                await sock.send_multipart([identity, *encode(ack)])
            if behaviour == "reject":
                ok.ok, ok.error = False, "no such lease"
            await sock.send_multipart([identity, *encode(ok)])
            await sock.send_multipart([identity, *encode(ok)])  # duplicated
            previous.append(ok)

    return sock, f"tcp://127.0.0.1:{port}", asyncio.create_task(serve_forever())


def test_stray_duplicated_and_late_acks_are_ignored(loaded):
    ids = prompt(loaded, 22, seed=7)

    async def body():
        ctx = zmq.asyncio.Context()
        p = await start_worker(loaded, role="prefill", kv_push_timeout_ms=3000)
        p.pusher.max_push_bytes = 1  # one block per push: six pushes per lease
        log: list = []
        sock, endpoint, task = await fake_decode(ctx, log, "ok")
        try:
            for i in range(2):
                lease = worker_pb2.KVLease(
                    lease_id=f"L{i}", epoch=7, kv_endpoint=endpoint, num_blocks=6
                )
                pre = await stub(p).Prefill(prefill_pb(f"r{i}", ids, lease))
                assert pre.kv_bytes > 0
            headers = [h for h, _ in log]
            assert [h.first_block for h in headers] == list(range(6)) * 2
            assert [h.last for h in headers] == ([False] * 5 + [True]) * 2
            assert all(n == 1 for _, n in log)
            # a receiver that rejects the push fails the prefill with FAILED_PRECONDITION
            task.cancel()
            sock.close(linger=0)
            sock, endpoint, task = await fake_decode(ctx, log, "reject")
            lease = worker_pb2.KVLease(lease_id="L9", epoch=1, kv_endpoint=endpoint, num_blocks=6)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(p).Prefill(prefill_pb("r9", ids, lease))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await wait_free(p, 64)).load.num_free_blocks == 64
        finally:
            task.cancel()
            sock.close(linger=0)
            await p.stop()
            ctx.destroy(linger=0)

    run(body())


def test_wrong_epoch_and_malformed_pushes_are_rejected_and_survived(loaded):
    ids = prompt(loaded, 10, seed=8)
    params = PARAMS

    async def body():
        ctx = zmq.asyncio.Context()
        d = await start_worker(loaded, role="decode")
        p = await start_worker(loaded, role="prefill")
        replies = Replies(ctx)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(d.kv_endpoint)
        try:
            reserve = worker_pb2.ReserveKVRequest(request_id="a", num_prompt_tokens=len(ids))
            lease = (await stub(d).ReserveKV(reserve)).lease
            block = torch.zeros(d.engine.kv.block_shape)
            layout = d.kv_layout

            async def push(header, frames) -> dataplane_pb2.KVTransferAck:
                await dealer.send_multipart(encode(header, frames))
                raw = await asyncio.wait_for(dealer.recv_multipart(), 5)
                ack, _ = decode(raw, dataplane_pb2.KVTransferAck)
                assert ack.transfer_id == header.transfer_id
                return ack

            def header(**kw):
                base = dict(
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    request_id="a",
                    first_block=0,
                    layout=layout,
                    transfer_id="t",
                )
                base.update(kw)
                return dataplane_pb2.KVTransferHeader(**base)

            frame = block.numpy().tobytes()
            ack = await push(header(epoch=lease.epoch + 1, transfer_id="t1"), [frame])
            assert not ack.ok and "epoch" in ack.error
            # malformed: garbage header, nothing but a header frame of noise, empty frame list
            await dealer.send_multipart([b"\xff\xff\xff garbage"])
            await dealer.send_multipart([b"\x08"])
            ack = await push(header(transfer_id="t2"), [frame[:10]])  # short payload
            assert not ack.ok and "bytes" in ack.error
            bad_layout = dataplane_pb2.KVLayout(**{**_fields(layout), "dtype": "float16"})
            ack = await push(header(transfer_id="t3", layout=bad_layout), [frame])
            assert not ack.ok and "layout" in ack.error
            ack = await push(header(transfer_id="t4", first_block=2), [frame, frame])
            assert not ack.ok and "outside" in ack.error
            ack = await push(header(transfer_id="t5", request_id="b"), [frame])
            assert not ack.ok
            # A GPU payload (CUDA IPC) that this CPU worker cannot map: refused with the
            # "cuda-ipc: " reason a pusher falls back to host memory on; so is one from
            # another host. The lease is untouched by either.
            gpu = dataplane_pb2.CudaIpcBuffer(
                host_id=host_id(), device_uuid="GPU-0", shape=[1, *block.shape], dtype="float32"
            )
            ack = await push(header(transfer_id="t6", cuda_ipc=gpu), [])
            assert not ack.ok and ack.error.startswith("cuda-ipc: ") and "GPU" in ack.error
            gpu.host_id = "another-host"
            ack = await push(header(transfer_id="t7", cuda_ipc=gpu), [])
            assert not ack.ok and ack.error.startswith("cuda-ipc: ")
            # the receiver survived: the real handoff still works on this lease
            pre = await stub(p).Prefill(prefill_pb("a", ids, lease, params))
            sd = start_decode_pb("a", ids, lease, pre.first_token_id, replies.endpoint, params)
            await stub(d).StartDecode(sd)
            [c] = await replies.until_finished("a")
            ref = reference_tokens(loaded, ids, params)[0]
            assert [pre.first_token_id, *c.tokens] == ref
            assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            dealer.close(linger=0)
            replies.close()
            await p.stop()
            await d.stop()
            ctx.destroy(linger=0)

    run(body())


def _fields(layout: dataplane_pb2.KVLayout) -> dict:
    return {f.name: getattr(layout, f.name) for f in layout.DESCRIPTOR.fields}


def test_first_token_that_ends_the_sequence(loaded):
    ids = prompt(loaded, 9, seed=11)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(loaded)  # unified: both sides of the handoff
        replies = Replies(ctx)
        try:
            reserve = worker_pb2.ReserveKVRequest(request_id="o", num_prompt_tokens=len(ids))
            lease = (await stub(w).ReserveKV(reserve)).lease
            pre = await stub(w).Prefill(prefill_pb("o", ids, lease, one))
            assert pre.finished
            sd = start_decode_pb("o", ids, lease, pre.first_token_id, replies.endpoint, one)
            await stub(w).StartDecode(sd)
            [c] = await replies.until_finished("o")
            assert c.tokens == [] and c.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert (await wait_free(w, 64)).load.num_free_blocks == 64
        finally:
            replies.close()
            await w.stop()
            ctx.destroy(linger=0)

    run(body())
