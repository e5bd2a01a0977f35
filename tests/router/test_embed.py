"""The router's Embed with fake workers: tokenizing text inputs, validation naming the field,
routing to the least loaded unified/prefill worker, retrying elsewhere, overload."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fakes import FakeWorker
from harness import Fleet, eventually, run

from llmfleet.v1 import embedding_pb2


class EmbedWorker(FakeWorker):
    """Embeds input ids as [len, sum]; answers `fail` (a status code) instead while set, and
    holds every call while `gate` is set and not open."""

    def __init__(self, worker_id: str, role: str = "unified", fail=None) -> None:
        super().__init__(worker_id, role)
        self.fail = fail
        self.gate: asyncio.Event | None = None

    async def Embed(self, request, context):
        self.calls.append(("Embed", request))
        if self.fail is not None:
            await context.abort(self.fail, f"{self.worker_id} says no")
        if self.gate is not None:
            await self.gate.wait()
        ids = [list(i.tokens.token_ids) for i in request.inputs]
        return embedding_pb2.EmbedResponse(
            request_id=request.request_id,
            embeddings=[
                embedding_pb2.Embedding(values=[len(x), sum(x)], num_prompt_tokens=len(x))
                for x in ids
            ],
            num_prompt_tokens=sum(map(len, ids)),
        )


async def add(fleet: Fleet, worker: EmbedWorker) -> EmbedWorker:
    await worker.start()
    fleet.workers.append(worker)
    worker.start_heartbeats(fleet.server.address)
    await eventually(lambda: fleet.router.registry.is_live(worker.worker_id), what="live")
    return worker


def request(*inputs, **kw) -> embedding_pb2.EmbedRequest:
    return embedding_pb2.EmbedRequest(
        inputs=[
            embedding_pb2.EmbedInput(text=x)
            if isinstance(x, str)
            else embedding_pb2.EmbedInput(tokens=embedding_pb2.EmbedTokens(token_ids=x))
            for x in inputs
        ],
        **kw,
    )


def test_text_is_tokenized_and_the_least_loaded_worker_embeds():
    async def body():
        async with Fleet() as fleet:
            busy = EmbedWorker("busy")
            busy.load.num_running = 5
            await add(fleet, busy)
            idle = await add(fleet, EmbedWorker("idle", role="prefill"))
            req = request("héllo", [1, 2, 3], pooling=embedding_pb2.POOLING_MEAN, dimensions=8)
            resp = await fleet.stub.Embed(req)
            assert [list(e.values) for e in resp.embeddings] == [[6, sum(b"h\xc3\xa9llo")], [3, 6]]
            assert resp.num_prompt_tokens == 9
            [sent] = idle.requests("Embed")
            assert busy.requests("Embed") == []
            assert sent.pooling == embedding_pb2.POOLING_MEAN and sent.dimensions == 8
            assert all(i.WhichOneof("input") == "tokens" for i in sent.inputs)

    run(body())


def test_a_gone_or_draining_worker_is_left_for_another():
    async def body():
        async with Fleet(max_retries=2) as fleet:
            down = await add(fleet, EmbedWorker("down", fail=grpc.StatusCode.UNAVAILABLE))
            drain = EmbedWorker("drain", fail=grpc.StatusCode.FAILED_PRECONDITION)
            drain.load.num_running = 1
            await add(fleet, drain)
            ok = EmbedWorker("ok")
            ok.load.num_running = 2
            await add(fleet, ok)
            resp = await fleet.stub.Embed(request([7, 7]))
            assert [list(e.values) for e in resp.embeddings] == [[2, 14]]
            assert [len(w.requests("Embed")) for w in (down, drain, ok)] == [1, 1, 1]
            ok.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.stub.Embed(request([7]))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    run(body())


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (request(), "inputs"),
        (request("ok", ""), "inputs[1]"),
        (request("x" * 300), "inputs[0]"),  # the fake model's context is 256 tokens
        (request([1], [299, 300]), "inputs[1]"),  # its vocabulary is 300
        (request("ok", pooling=7), "pooling"),
        (request("ok", dimensions=0), "dimensions"),
    ],
)
def test_invalid_requests_name_the_field(req, field):
    async def body():
        async with Fleet() as fleet:
            worker = await add(fleet, EmbedWorker("w"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.stub.Embed(req)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: ")
            assert worker.requests("Embed") == []

    run(body())


def test_the_worker_invalid_argument_comes_back_and_admission_is_bounded():
    async def body():
        async with Fleet(max_queued_requests=1) as fleet:
            worker = await add(fleet, EmbedWorker("w", fail=grpc.StatusCode.INVALID_ARGUMENT))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.stub.Embed(request("ok"))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            worker.fail, worker.gate = None, asyncio.Event()
            first = asyncio.ensure_future(fleet.stub.Embed(request("ok")))
            await eventually(lambda: len(worker.requests("Embed")) == 2, what="first embed")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.stub.Embed(request("ok"))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            worker.gate.set()
            assert (await first).num_prompt_tokens == 2

    run(body())
