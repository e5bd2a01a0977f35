"""The client library and `llmfleet generate/chat` against a scripted Generation server.

The fake server (grpc.aio on 127.0.0.1:0, in a thread of this process) answers every prompt
with completions "reply I to <prompt>", streamed in three pieces per completion, interleaved
with the highest index first so completions finish out of order. A prompt containing "bad" is
rejected with INVALID_ARGUMENT and a message naming a field, as the router does.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from llmfleet.cli.main import main
from llmfleet.client.generation import AsyncGenerationClient, ClientError, GenerationClient
from llmfleet.client.messages import Delta, build_request
from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)

BAD_MESSAGE = "sampling.temperature: must be in [0, 2], got 3.0"


def _prompt_text(req: generation_pb2.GenerateRequest) -> str:
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return req.text
    if kind == "chat":
        return req.chat.messages[-1].content
    return " ".join(str(t) for t in req.tokens.token_ids)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.aborted: list[str] = []

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        prompt = _prompt_text(request)
        if "bad" in prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, BAD_MESSAGE)
        n = request.sampling.n if request.sampling.HasField("n") else 1
        rid = request.request_id or "assigned-1"
        pieces = {i: _pieces(f"reply {i} to {prompt}") for i in range(n)}
        for k in range(3):
            for i in reversed(range(n)):
                delta = generation_pb2.CompletionDelta(
                    index=i, text=pieces[i][k], token_ids=[100 + 10 * i + k]
                )
                if request.sampling.HasField("logprobs"):
                    top = [
                        common_pb2.TokenLogprob(token_id=j, logprob=-1.0 - j)
                        for j in range(request.sampling.logprobs)
                    ]
                    delta.logprobs.append(
                        common_pb2.PositionLogprobs(
                            sampled=common_pb2.TokenLogprob(
                                token_id=100 + 10 * i + k, logprob=-0.5
                            ),
                            rank=1,
                            top=top,
                        )
                    )
                if k == 2:
                    if request.sampling.stop:
                        delta.finish_reason = common_pb2.FINISH_REASON_STOP
                        delta.stop_string = request.sampling.stop[0]
                    else:
                        delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                yield generation_pb2.GenerateResponse(request_id=rid, deltas=[delta])
        yield generation_pb2.GenerateResponse(
            request_id=rid,
            usage=common_pb2.Usage(
                prompt_tokens=7, completion_tokens=3 * n, cached_prompt_tokens=2
            ),
        )

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return generation_pb2.AbortResponse(found=request.request_id == "r1")

    async def GetModelInfo(self, request, context):
        return generation_pb2.GetModelInfoResponse(
            model=common_pb2.ModelInfo(
                model_id="tiny", architecture="LlamaForCausalLM", vocab_size=1000,
                max_model_len=2048, eos_token_ids=[2], max_n=16, max_logprobs=20, block_size=16,
            )
        )  # fmt: skip

    async def GetServerInfo(self, request, context):
        return generation_pb2.GetServerInfoResponse(
            version="0.1.0",
            mode="aggregated",
            routing_policy="prefix_aware",
            workers=[
                generation_pb2.WorkerStatus(
                    worker_id="worker-0",
                    role=common_pb2.WORKER_ROLE_UNIFIED,
                    address="127.0.0.1:1234",
                    load=common_pb2.LoadReport(num_running=1, num_free_blocks=10),
                )
            ],
        )


def _pieces(text: str) -> list[str]:
    a, b = len(text) // 3, 2 * len(text) // 3
    return [text[:a], text[a:b], text[b:]]


class _Server:
    """The fake on its own event loop thread."""

    def __init__(self) -> None:
        self.servicer = FakeGeneration()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self._run(self._start())
        self.endpoint = f"127.0.0.1:{self.port}"

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server

    def close(self) -> None:
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


@pytest.fixture
def unreachable() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---- client library -----------------------------------------------------------------------


def test_build_request_prompt_forms():
    chat = build_request("hi")
    assert chat.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]
    assert build_request("hi", raw=True).text == "hi"
    assert list(build_request(token_ids=[1, 2]).tokens.token_ids) == [1, 2]
    two = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    msgs = build_request(messages=two)
    assert [m.role for m in msgs.chat.messages] == ["system", "user"]
    req = build_request("hi", max_tokens=5, temperature=0.0, seed=3, stop=["x"])
    assert req.sampling.max_tokens == 5 and req.sampling.HasField("temperature")
    assert not req.sampling.HasField("top_p")  # unset: the server's default
    assert list(req.sampling.stop) == ["x"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "token_ids": [1]}, "prompt"),
        ({"prompt": "a", "stop": "x"}, "stop"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"token_ids": [1, 2**64]}, "token_ids[1]"),
        ({"token_ids": [1, "7"]}, "token_ids[1]"),
        ({"token_ids": "17"}, "token_ids"),
        ({"prompt": "a", "stop_token_ids": [2.5]}, "stop_token_ids[0]"),
    ],
)
def test_build_request_rejects_malformed_arguments(kwargs, field):
    with pytest.raises(ValidationError) as info:
        build_request(**kwargs)
    assert info.value.field == field


def test_sync_generate_collects_completions_and_usage(server):
    with GenerationClient(server.endpoint) as client:
        res = client.generate("hello", n=2, max_tokens=3, logprobs=1, request_id="mine")
    req = server.servicer.requests[-1]
    assert req.request_id == "mine" and req.WhichOneof("prompt") == "chat"
    assert res.request_id == "mine"
    assert [c.text for c in res.completions] == ["reply 0 to hello", "reply 1 to hello"]
    assert res.completions[1].token_ids == [110, 111, 112]
    assert [c.finish_reason for c in res.completions] == ["length", "length"]
    lp = res.completions[0].logprobs[0]
    assert (lp.token_id, lp.logprob, lp.rank, lp.top_token_ids) == (100, -0.5, 1, [0])
    assert res.usage is not None
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (7, 6)
    assert res.usage.cached_prompt_tokens == 2


def test_sync_stream_yields_deltas_then_usage(server):
    with GenerationClient(server.endpoint) as client:
        stream = client.stream("hello", raw=True, stop=["!"])
        deltas = list(stream)
    assert server.servicer.requests[-1].text == "hello"
    assert all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == "reply 0 to hello"
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert deltas[-1].stop_string == "!"
    assert stream.request_id == "assigned-1" and stream.usage is not None


def test_sync_errors_carry_the_server_status_and_message(server, unreachable):
    with GenerationClient(server.endpoint) as client, pytest.raises(ClientError) as info:
        client.generate("a bad prompt")
    assert info.value.code_name == "INVALID_ARGUMENT" and info.value.message == BAD_MESSAGE
    with GenerationClient(unreachable) as client, pytest.raises(ClientError) as info:
        client.model_info()
    assert info.value.code_name == "UNAVAILABLE"


def test_sync_unary_calls(server):
    with GenerationClient(server.endpoint) as client:
        assert client.abort("r1") is True and client.abort("other") is False
        info = client.model_info()
        assert (info.model_id, info.vocab_size, info.eos_token_ids) == ("tiny", 1000, (2,))
        fleet = client.server_info()
    assert (fleet.mode, fleet.routing_policy) == ("aggregated", "prefix_aware")
    [w] = fleet.workers
    assert (w.worker_id, w.role, w.address, w.num_running, w.num_free_blocks) == (
        "worker-0", "unified", "127.0.0.1:1234", 1, 10,
    )  # fmt: skip


def test_async_client(server):
    async def body() -> None:
        async with AsyncGenerationClient(server.endpoint) as client:
            res = await client.generate(token_ids=[5, 6], n=3)
            assert [c.text for c in res.completions] == [f"reply {i} to 5 6" for i in range(3)]
            assert res.usage is not None and res.usage.completion_tokens == 9
            texts = [
                d.text async for d in client.stream(messages=[{"role": "user", "content": "x"}])
            ]
            assert "".join(texts) == "reply 0 to x"
            assert await client.abort("r1") is True
            assert (await client.model_info()).block_size == 16
            assert len((await client.server_info()).workers) == 1
            with pytest.raises(ClientError) as info:
                await client.generate("bad")
            assert info.value.code_name == "INVALID_ARGUMENT" and info.value.message == BAD_MESSAGE
            with pytest.raises(ClientError) as info:
                async for _ in client.stream("bad"):
                    pass
            assert info.value.message == BAD_MESSAGE

    asyncio.run(body())


# ---- the command line ---------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_prints_only_the_completion(server, capsys):
    code, out, err = _cli(capsys, "generate", "--endpoint", server.endpoint, "What is up?")
    assert code == 0, err
    assert out == "reply 0 to What is up?\n"
    req = server.servicer.requests[-1]
    assert req.WhichOneof("prompt") == "chat"
    assert req.sampling.max_tokens == 256 and req.sampling.temperature == 0.0


def test_generate_flags_reach_the_request(server, capsys):
    argv = ["generate", "--endpoint", server.endpoint, "--raw", "--max-tokens", "9"]
    argv += ["--temperature", "0.7", "--seed", "5", "--stop", "x", "--top-k", "4", "go"]
    code, out, _ = _cli(capsys, *argv)
    assert code == 0 and out == "reply 0 to go\n"
    s = server.servicer.requests[-1].sampling
    assert server.servicer.requests[-1].text == "go"
    assert (s.max_tokens, s.temperature, s.seed, list(s.stop), s.top_k) == (9, 0.7, 5, ["x"], 4)
    assert not s.HasField("top_p")


def test_generate_n_streamed_equals_unstreamed(server, capsys):
    base = ["generate", "--endpoint", server.endpoint, "--n", "3", "hi"]
    code, plain, _ = _cli(capsys, *base)
    assert code == 0
    assert plain == "".join(f"--- completion {i} ---\nreply {i} to hi\n" for i in range(3))
    code, streamed, _ = _cli(capsys, *base, "--stream")
    assert code == 0 and streamed == plain


def test_generate_logprobs_go_to_stderr_as_json_lines(server, capsys):
    code, out, err = _cli(
        capsys, "generate", "--endpoint", server.endpoint, "--logprobs", "2", "--stream", "hi"
    )
    assert code == 0 and out == "reply 0 to hi\n"
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [r["position"] for r in records] == [0, 1, 2]
    assert records[0] == {
        "completion": 0, "position": 0, "token_id": 100, "logprob": -0.5, "rank": 1,
        "top": [{"token_id": 0, "logprob": -1.0}, {"token_id": 1, "logprob": -2.0}],
    }  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_argument_exits_2_with_the_server_message(server, capsys, stream):
    argv = ["generate", "--endpoint", server.endpoint, "--temperature", "3", "bad"]
    code, out, err = _cli(capsys, *argv, *(["--stream"] if stream else []))
    assert code == 2
    assert out == ""
    assert BAD_MESSAGE in err


def test_unreachable_endpoint_exits_1_with_a_clear_message(unreachable, capsys):
    code, out, err = _cli(capsys, "generate", "--endpoint", unreachable, "hi")
    assert code == 1 and out == ""
    assert f"cannot reach llmfleet at {unreachable}" in err and "llmfleet up" in err


def test_endpoint_from_the_environment(server, capsys, monkeypatch):
    monkeypatch.setenv("LLMFLEET_ENDPOINT", server.endpoint)
    code, out, _ = _cli(capsys, "generate", "env")
    assert code == 0 and out == "reply 0 to env\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-tokens", "many", "hi"],
        ["generate", "--temperature", "hot", "hi"],
        ["generate", "--dtype", "int3", "hi"],
        ["generate"],
        ["generate", "--model", "/some/path", "hi"],
        ["frobnicate"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    code, out, err = _cli(capsys, *argv)  # each fails before any connection is made
    assert code == 2 and out == "" and err


def test_chat_streams_a_multi_turn_conversation(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("first question\nsecond question\n\n"))
    code, out, _ = _cli(capsys, "chat", "--endpoint", server.endpoint, "--system", "be nice")
    assert code == 0
    assert out == "reply 0 to first question\nreply 0 to second question\n"
    last = server.servicer.requests[-1].chat.messages
    assert [(m.role, m.content) for m in last] == [
        ("system", "be nice"),
        ("user", "first question"),
        ("assistant", "reply 0 to first question"),
        ("user", "second question"),
    ]


def test_chat_error_exits_2_with_the_message(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("a bad question\n"))
    code, _, err = _cli(capsys, "chat", "--endpoint", server.endpoint)
    assert code == 2 and BAD_MESSAGE in err
