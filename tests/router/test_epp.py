"""The router's Envoy ext_proc endpoint picker and worker pins, in process: a router with a fake
tokenizer and fake workers (harness.py), a real ext_proc stream from an xds-protos client."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from fakes import prompt_hashes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import Fleet, eventually, run, sampling

from llmfleet.services.router.epp_pick import openai_prompt
from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import common_pb2, generation_pb2

TARGET_PORT = 8123
PROMPT = "the quick brown fox jumps over the lazy dog, twice over"  # 14 blocks of 4 bytes
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def epp_fleet(**config) -> Fleet:
    return Fleet(routing_policy="prefix_aware", epp_port=0, epp_target_port=TARGET_PORT, **config)


def request_messages(
    path: str, body: bytes | None, *, duplex: bool = False, chunks: int = 1
) -> list[ext_proc.ProcessingRequest]:
    """What a proxy sends for one HTTP POST: headers, then the body in `chunks` pieces."""
    headers = [
        base_pb2.HeaderValue(key=k, raw_value=v.encode())
        for k, v in ((":method", "POST"), (":path", path), ("content-type", "application/json"))
    ]
    first = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=headers), end_of_stream=body is None
        )
    )
    if duplex:
        first.protocol_config.request_body_mode = _DUPLEX
    out = [first]
    if body is not None:
        step = -(-len(body) // chunks)
        for i in range(0, len(body), step):
            piece = ext_proc.HttpBody(body=body[i : i + step], end_of_stream=i + step >= len(body))
            out.append(ext_proc.ProcessingRequest(request_body=piece))
    return out


async def exchange(
    address: str, messages: list[ext_proc.ProcessingRequest]
) -> list[ext_proc.ProcessingResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
        for m in messages:
            await call.write(m)
        await call.done_writing()
        return [r async for r in call]


def set_headers(resp: ext_proc.ProcessingResponse, phase: str) -> dict[str, str]:
    mutation = getattr(resp, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def completion(prompt: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()


async def hold_prefix(f: Fleet, worker, **prompt) -> None:
    """Run one request pinned to `worker` (an `x-llmfleet-worker` call) so it caches the prompt."""
    req = {"sampling": sampling(max_tokens=2), **prompt}
    calls = len(worker.requests("AddRequest"))
    md = (("x-llmfleet-worker", worker.address),)
    _ = [r async for r in f.stub.Generate(generation_pb2.GenerateRequest(**req), metadata=md)]
    assert len(worker.requests("AddRequest")) == calls + 1  # the pin took it there


def test_pick_names_the_worker_holding_the_prefix_buffered_and_full_duplex():
    async def body():
        async with epp_fleet() as f:
            w0, w1 = await f.add_worker("w0"), await f.add_worker("w1")
            await eventually(lambda: f.server.serving, what="router serving")
            # Without a prefix anywhere the least loaded wins, ties by id: w0. Pin the prompt to w1.
            await hold_prefix(f, w1, text=PROMPT)
            hashes = prompt_hashes(list(PROMPT.encode()))
            index = f.router.kv.index
            await eventually(lambda: index.matched_prefix("w1", hashes) == len(hashes))
            address = f.server.epp.address

            buffered = await exchange(
                address, request_messages("/v1/completions", completion(PROMPT), chunks=3)
            )
            # headers: continue; two body chunks: continue; the last chunk: the pick.
            assert [r.WhichOneof("response") for r in buffered] == [
                "request_headers", "request_body", "request_body", "request_body"
            ]  # fmt: skip
            assert set_headers(buffered[0], "request_headers") == {}
            last = buffered[-1]
            assert set_headers(last, "request_body") == {
                "x-gateway-destination-endpoint": f"127.0.0.1:{TARGET_PORT}",
                "x-llmfleet-worker": w1.address,
            }
            assert last.request_body.response.clear_route_cache
            lb = last.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields["x-gateway-destination-endpoint"].string_value == (
                f"127.0.0.1:{TARGET_PORT}"
            )

            body_bytes = completion(PROMPT)
            duplex = await exchange(
                address, request_messages("/v1/completions", body_bytes, duplex=True, chunks=2)
            )
            # The headers' answer waits for the whole body; the body goes back unchanged.
            assert [r.WhichOneof("response") for r in duplex] == ["request_headers", "request_body"]
            assert set_headers(duplex[0], "request_headers")["x-llmfleet-worker"] == w1.address
            streamed = duplex[1].request_body.response.body_mutation.streamed_response
            assert streamed.body == body_bytes and streamed.end_of_stream

            # Another prompt: no prefix anywhere, the least loaded by id (w0).
            other = await exchange(
                address, request_messages("/v1/completions", completion("zz" * 30))
            )
            assert set_headers(other[-1], "request_body")["x-llmfleet-worker"] == w0.address
            # Nothing was admitted by the picks: only the pinned request ever ran.
            assert f.router.runs == {} and len(w0.requests("AddRequest")) == 0

    run(body())


def test_chat_is_rendered_as_the_router_renders_it():
    async def body():
        async with epp_fleet() as f:
            await f.add_worker("w0")
            w1 = await f.add_worker("w1")
            await eventually(lambda: f.server.serving, what="router serving")
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": PROMPT},
            ]
            chat = common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(**m) for m in messages])
            await hold_prefix(f, w1, chat=chat)
            rendered = "".join(f"{m['role']}: {m['content']}\n" for m in messages)  # fakes.py
            hashes = prompt_hashes(list(rendered.encode()))
            await eventually(lambda: f.router.kv.index.matched_prefix("w1", hashes) == len(hashes))
            body_bytes = json.dumps({"model": "m", "messages": messages}).encode()
            out = await exchange(
                f.server.epp.address, request_messages("/v1/chat/completions", body_bytes)
            )
            assert set_headers(out[-1], "request_body")["x-llmfleet-worker"] == w1.address

    run(body())


def test_malformed_body_is_400_and_no_worker_is_503_and_health_follows_the_router():
    async def body():
        async with epp_fleet(max_message_bytes=4096) as f:
            address = f.server.epp.address
            async with grpc.aio.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest())
                assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
                [resp] = await exchange(address, request_messages("/v1/models", None))
                assert resp.immediate_response.status.code == 503

                await f.add_worker("w0")
                deadline = asyncio.get_running_loop().time() + 5
                while check.status != health_pb2.HealthCheckResponse.SERVING:
                    assert asyncio.get_running_loop().time() < deadline, "EPP not SERVING"
                    await asyncio.sleep(0.01)
                    check = await health.Check(health_pb2.HealthCheckRequest())
            cases = [
                (b"{not json", "body"),
                (b"[1, 2]", "body"),
                (completion(None), "prompt"),
                (completion([["a"], ["b"]]), "prompt"),
                (completion([1, "x"]), "prompt"),
            ]
            for raw, param in cases:
                out = await exchange(address, request_messages("/v1/completions", raw))
                immediate = out[-1].immediate_response
                assert immediate.status.code == 400, raw
                error = json.loads(immediate.body)["error"]
                assert error["param"] == param and error["type"] == "invalid_request_error"
            chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": 3}]})
            out = await exchange(address, request_messages("/v1/chat/completions", chat.encode()))
            error = json.loads(out[-1].immediate_response.body)["error"]
            assert error["param"] == "messages[0].content"
            # The tokenizer's refusal, named as the body names it.
            chat = json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
            out = await exchange(address, request_messages("/v1/chat/completions", chat.encode()))
            assert out[-1].immediate_response.status.code == 400
            error = json.loads(out[-1].immediate_response.body)["error"]
            assert error["param"] == "messages[0].role" and "robot" in error["message"]
            # Over the router's message limit: 413, before the body ends.
            big = completion("x" * 5000)
            out = await exchange(address, request_messages("/v1/completions", big, chunks=4))
            assert out[-1].immediate_response.status.code == 413
            # A bodiless request (GET /v1/models) is picked by load, in the headers' answer.
            [resp] = await exchange(address, request_messages("/v1/models", None))
            assert set_headers(resp, "request_headers")["x-llmfleet-worker"] == f.workers[0].address

    run(body())


def test_pin_by_id_is_honoured_and_unknown_or_draining_workers_route_as_usual():
    async def body():
        async with epp_fleet() as f:
            w0, w1 = await f.add_worker("w0"), await f.add_worker("w1")
            await eventually(lambda: f.server.serving, what="router serving")

            async def generate(pin: str) -> None:
                md = (("x-llmfleet-worker", pin),)
                text = f"{pin}: hi"  # (its own first block: no prefix draws it anywhere)
                req = generation_pb2.GenerateRequest(text=text, sampling=sampling(max_tokens=2))
                out = [r async for r in f.stub.Generate(req, metadata=md)]
                assert out[-1].usage.completion_tokens == 2

            # Idle and without prefixes the policy takes w0 (ties by id).
            await generate("w1")  # by id
            await generate("10.9.9.9:1")  # no such worker: as usual
            f.router.registry.set_draining("w1")
            await generate(w1.address)  # draining: as usual
            assert len(w1.requests("AddRequest")) == 1
            assert len(w0.requests("AddRequest")) == 2
            assert len(f.router.placement.pins) == 0  # released with the calls

    run(body())


@pytest.mark.parametrize(
    "path, body, expect",
    [
        ("/v1/completions", {"prompt": "hi"}, ("text", "hi")),
        ("/v1/completions?x=1", {"prompt": [5, 6]}, ("tokens", [5, 6])),
        ("/v1/completions", {"prompt": [[7, 8]]}, ("tokens", [7, 8])),
        ("/v1/completions", {"prompt": ["one"]}, ("text", "one")),
        ("/v1/embeddings", {"input": "x"}, (None, None)),
    ],
)
def test_openai_prompt_reads_the_prompt_as_the_gateway_sends_it(path, body, expect):
    req = openai_prompt(path, json.dumps(body).encode())
    kind = req.WhichOneof("prompt")
    value = {"text": req.text, "tokens": list(req.tokens.token_ids), None: None}[kind]
    assert (kind, value) == expect


def test_openai_prompt_chat_parts_and_roles():
    body = {
        "messages": [
            {"role": "developer", "content": "sys"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        "add_generation_prompt": False,
        "user": "s1",
    }
    req = openai_prompt("/v1/chat/completions", json.dumps(body).encode())
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "sys"), ("user", "ab"), ("assistant", "")
    ]  # fmt: skip
    assert req.chat.add_generation_prompt is False and req.session_id == "s1"
    with pytest.raises(ValidationError) as e:
        openai_prompt("/v1/chat/completions", b'{"messages": []}')
    assert e.value.field == "messages"
