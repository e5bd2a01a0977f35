"""Generate through an in-process router with fake workers: streaming, n, stop strings,
validation errors, cancellation."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import (
    Fleet,
    eventually,
    finish_of,
    letters,
    read_rest,
    run,
    sampling,
    text_of,
    tokens_of,
)
from prometheus_client import REGISTRY

from llmfleet.v1 import common_pb2, generation_pb2


def test_streams_deltas_and_usage():
    async def body():
        async with Fleet() as fleet:
            # Steps of 20 ms: the stream keeps up, so no steps are joined into one message.
            await fleet.add_worker("w1", step_s=0.02)
            out, text = await fleet.generate(text="hello", sampling=sampling(max_tokens=6))
            assert text == letters(5, 6)
            assert tokens_of(out, 0) == [ord(c) for c in letters(5, 6)]
            assert len(out) == 6  # one delta per engine step
            assert finish_of(out, 0).finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert all(not r.HasField("usage") for r in out[:-1])
            assert out[-1].usage.prompt_tokens == 5 and out[-1].usage.completion_tokens == 6
            # the same prompt again finds its full blocks (one block of 4) cached
            out, _ = await fleet.generate(text="hello", sampling=sampling(max_tokens=2))
            assert out[-1].usage.cached_prompt_tokens == 4
            assert {r.request_id for r in out} == {out[0].request_id}

    run(body())


def test_n2_streams_both_completions():
    async def body():
        async with Fleet() as fleet:
            await fleet.add_worker("w1")
            out, _ = await fleet.generate(
                request_id="r-n2",
                tokens=generation_pb2.TokenPrompt(token_ids=[1, 2, 3]),
                sampling=sampling(n=2, max_tokens=4),
            )
            assert text_of(out, 0) == letters(3, 4, 0)
            assert text_of(out, 1) == letters(3, 4, 1)
            assert out[-1].usage.completion_tokens == 8
            assert all(r.request_id == "r-n2" for r in out)

    run(body())


def test_stop_string_finishes_completion_and_cancels_on_worker():
    async def body():
        async with Fleet() as fleet:
            w = await fleet.add_worker("w1")
            # prompt of 3 tokens: output letters from position 3 = "defghijk..."
            out, text = await fleet.generate(
                text="abc", sampling=sampling(max_tokens=20, stop=["gh"])
            )
            assert text == "def"
            end = finish_of(out, 0)
            assert end.finish_reason == common_pb2.FINISH_REASON_STOP and end.stop_string == "gh"
            assert out[-1].HasField("usage")
            await eventually(lambda: w.requests("Cancel"), what="Cancel")
            cancel = w.requests("Cancel")[0]
            assert cancel.reason == common_pb2.FINISH_REASON_STOP and cancel.stop_string == "gh"
            assert cancel.HasField("index") and cancel.index == 0

            out, text = await fleet.generate(
                text="abc",
                sampling=sampling(max_tokens=20, stop=["gh"], include_stop_str_in_output=True),
            )
            assert text == "defgh"

    run(body())


@pytest.mark.parametrize(
    "req, field",
    [
        (dict(), "prompt"),
        (dict(text=""), "text"),
        (dict(tokens=generation_pb2.TokenPrompt(token_ids=[])), "tokens.token_ids"),
        (dict(tokens=generation_pb2.TokenPrompt(token_ids=[1, 999])), "tokens.token_ids"),
        (dict(text="hi", sampling=sampling(temperature=5.0)), "sampling.temperature"),
        (dict(text="hi", sampling=sampling(max_tokens=0)), "sampling.max_tokens"),
        (dict(text="hi", sampling=sampling(max_tokens=255)), "sampling.max_tokens"),
        (dict(text="hi", sampling=sampling(n=5)), "sampling.n"),
        (dict(text="hi", sampling=sampling(logprobs=6)), "sampling.logprobs"),
        (
            dict(
                chat=common_pb2.ChatPrompt(
                    messages=[common_pb2.ChatMessage(role="wizard", content="x")]
                )
            ),
            "chat.messages[0].role",
        ),
    ],
)
def test_invalid_argument_names_the_field(req, field):
    async def body():
        async with Fleet() as fleet:
            await fleet.add_worker("w1")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.generate(**req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field + ":"), err.value.details()
            if field == "sampling.max_tokens" and "255" in str(req):
                assert "2 tokens" in err.value.details() and "256" in err.value.details()

    run(body())


def test_no_workers_is_unavailable_and_queue_limit_is_resource_exhausted():
    async def body():
        async with Fleet(max_queued_requests=1) as fleet:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.generate(text="hi")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await fleet.add_worker("w1", step_s=0.05)
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(text="hi", sampling=sampling(max_tokens=50))
            )
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.generate(text="hi")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            call.cancel()

    run(body())


def test_chat_prompt_and_model_and_server_info():
    async def body():
        async with Fleet() as fleet:
            await fleet.add_worker("w1")
            chat = common_pb2.ChatPrompt(
                messages=[common_pb2.ChatMessage(role="user", content="x")]
            )
            out, text = await fleet.generate(chat=chat, sampling=sampling(max_tokens=2))
            assert out[-1].usage.prompt_tokens == len("user: x\n")
            info = await fleet.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
            assert info.model.model_id == "fake-model" and info.model.block_size == 4
            server = await fleet.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
            assert server.mode == "aggregated" and server.routing_policy == "round_robin"
            assert [w.worker_id for w in server.workers] == ["w1"]
            assert server.workers[0].load.num_total_blocks == 100

    run(body())


def test_client_cancel_sends_cancel_to_worker():
    async def body():
        async with Fleet() as fleet:
            w = await fleet.add_worker("w1", step_s=0.02)
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(
                    request_id="c1", text="hello", sampling=sampling(max_tokens=200)
                )
            )
            await call.read()
            call.cancel()
            await eventually(lambda: w.requests("Cancel"), what="Cancel")
            cancel = w.requests("Cancel")[0]
            assert cancel.request_id == "c1"
            assert cancel.reason == common_pb2.FINISH_REASON_ABORT
            assert not cancel.HasField("index")
            await eventually(lambda: not fleet.router.runs, what="request state dropped")

    run(body())


def test_abort_rpc_ends_stream_and_cancels_on_worker():
    async def body():
        async with Fleet() as fleet:
            w = await fleet.add_worker("w1", step_s=0.02)
            call = fleet.stub.Generate(
                generation_pb2.GenerateRequest(
                    request_id="a1", text="hello", sampling=sampling(max_tokens=200)
                )
            )
            first = await call.read()
            assert first.deltas
            resp = await fleet.stub.Abort(generation_pb2.AbortRequest(request_id="a1"))
            assert resp.found
            rest = await read_rest(call)
            end = finish_of(rest, 0)
            assert end.finish_reason == common_pb2.FINISH_REASON_ABORT
            assert rest[-1].HasField("usage")
            await eventually(lambda: w.requests("Cancel"), what="Cancel")
            assert w.requests("Cancel")[0].request_id == "a1"
            missing = await fleet.stub.Abort(generation_pb2.AbortRequest(request_id="nope"))
            assert not missing.found
            await asyncio.sleep(0)

    run(body())


def test_health_serving_only_with_tokenizer_and_worker_and_metrics_count():
    async def body():
        async with Fleet() as fleet:
            health = health_pb2_grpc.HealthStub(fleet.channel)

            async def status() -> int:
                resp = await health.Check(health_pb2.HealthCheckRequest())
                return resp.status

            assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
            w = await fleet.add_worker("w1")
            serving = health_pb2.HealthCheckResponse.SERVING
            for _ in range(100):
                if await status() == serving:
                    break
                await asyncio.sleep(0.02)
            assert await status() == serving
            labels = {"model_name": "fake-model", "finished_reason": "length"}
            before = REGISTRY.get_sample_value("vllm:request_success_total", labels) or 0.0
            await fleet.generate(text="hi", sampling=sampling(max_tokens=2))
            assert REGISTRY.get_sample_value("vllm:request_success_total", labels) == before + 1
            w.stop_heartbeats()
            for _ in range(100):
                if await status() != serving:
                    break
                await asyncio.sleep(0.02)
            assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING

    run(body())
