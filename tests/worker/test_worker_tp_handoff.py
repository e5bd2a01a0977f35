"""Disaggregated handoff between in-process workers of different tensor-parallel sizes: a TP=2
prefill worker (two CPU ranks, gloo) hands its KV to a TP=1 decode worker and the reverse,
the KV layout re-split per head on the way, with the tokens of a plain TP=1 engine; and a
TP=2 worker whose other rank died failing like a failing forward pass."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
import zmq
import zmq.asyncio
from worker_helpers import (
    Replies,
    add_request_pb,
    prompt,
    reference_tokens,
    run,
    start_worker,
    stub,
)

from llmfleet.models.loader import load_model
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import sampling_to_pb
from llmfleet.v1 import worker_pb2

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint_module) -> str:
    # 3 KV heads: at TP=2 rank 0 holds two, rank 1 one.
    return str(
        make_checkpoint_module(
            "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
        )
    )


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False)


async def handoff(p, d, rid: str, ids: list[int], replies: Replies) -> list[int]:
    """ReserveKV on d, Prefill on p into the lease, StartDecode on d: all the tokens."""
    reserve = worker_pb2.ReserveKVRequest(request_id=rid, num_prompt_tokens=len(ids))
    lease = (await stub(d).ReserveKV(reserve)).lease
    pre = await stub(p).Prefill(
        worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling_to_pb(PARAMS), lease=lease
        )
    )
    assert pre.kv_bytes > 0
    await stub(d).StartDecode(
        worker_pb2.StartDecodeRequest(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            request_id=rid,
            prompt_token_ids=ids,
            first_token_id=pre.first_token_id,
            sampling=sampling_to_pb(PARAMS),
            reply_endpoint=replies.endpoint,
        )
    )
    [c] = await replies.until_finished(rid)
    return [pre.first_token_id, *c.tokens]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_handoff_between_tp_sizes_gives_the_plain_tokens(checkpoint, loaded, prefill_tp, decode_tp):
    ids = prompt(loaded, 22, seed=4)
    want = reference_tokens(loaded, ids, PARAMS)[0]

    async def worker(role: str, tp: int):
        if tp == 1:
            return await start_worker(loaded, role=role)
        return await start_worker(
            None, role=role, engine_kw={"model": checkpoint, "tensor_parallel_size": 2}
        )

    async def body():
        ctx = zmq.asyncio.Context()
        p = await worker("prefill", prefill_tp)
        d = await worker("decode", decode_tp)
        replies = Replies(ctx)
        try:
            assert p.kv_layout == d.kv_layout  # all 3 heads on both
            assert d.kv_layout.num_kv_heads == 3
            assert await handoff(p, d, "r1", ids, replies) == want
        finally:
            replies.close()
            await p.stop()
            await d.stop()
            ctx.destroy(linger=0)

    run(body(), timeout=120)


def test_a_dead_rank_fails_the_worker_loudly(checkpoint, loaded):
    async def body():
        ctx = zmq.asyncio.Context()
        w = await start_worker(None, engine_kw={"model": checkpoint, "tensor_parallel_size": 2})
        replies = Replies(ctx)
        try:
            follower = w.engine.runner.ranks.procs[0]
            follower.kill()
            follower.wait()
            ids = prompt(loaded, 9)
            await stub(w).AddRequest(add_request_pb("r", ids, PARAMS, replies.endpoint))
            async with asyncio.timeout(30):
                while w.failure is None:  # the next step fails
                    await asyncio.sleep(0.02)
            assert "RankFailed: tensor-parallel rank 1 exited" in w.failure
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub(w).AddRequest(add_request_pb("r2", ids, PARAMS, replies.endpoint))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            replies.close()
            await w.stop(0)
            ctx.destroy(linger=0)

    run(body(), timeout=120)
