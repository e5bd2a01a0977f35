"""The tokenizer service: in-process over loopback gRPC, and as a real process.

Results must equal the core functions it wraps (tokenize_prompt, tokenize_chat,
IncrementalDetokenizer) for the bundled SmolLM2 tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.services.tokenizer.server import TokenizerServicer, load_tokenizer, start
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.wire.service import Service
from llmfleet.text.chat import tokenize_chat, tokenize_prompt
from llmfleet.text.detokenizer import IncrementalDetokenizer
from llmfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.timeout(120)

TEXT = (
    "The quick brown fox jumps over the lazy dog. 世界你好 🎉 héllo café. STOP here; "
    "then more text after the stop."
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(None)


@contextlib.asynccontextmanager
async def serving(tokenizer: Any) -> AsyncIterator[tuple[tokenizer_pb2_grpc.TokenizerStub, str]]:
    svc = await start(TokenizerConfig(port=0), tokenizer=tokenizer)
    channel = grpc.aio.insecure_channel(svc.address)
    try:
        yield tokenizer_pb2_grpc.TokenizerStub(channel), svc.address
    finally:
        await channel.close()
        svc.request_stop()
        await svc.wait_for_termination()


def _chat(*messages: tuple[str, str], add_generation_prompt: bool | None = None):
    chat = common_pb2.ChatPrompt(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


# ---- Tokenize -----------------------------------------------------------------------------


def test_tokenize_text_and_chat_equal_the_core_functions(tokenizer):
    messages = [
        ("system", "Be brief."),
        ("user", "What is 2+2?"),
        ("assistant", "4"),
        ("user", "And 3+3?"),
    ]
    as_dicts = [{"role": r, "content": c} for r, c in messages]

    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            got = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=TEXT))
            assert list(got.token_ids) == tokenize_prompt(tokenizer, TEXT)
            got = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=_chat(*messages)))
            assert list(got.token_ids) == tokenize_chat(tokenizer, as_dicts)
            req = tokenizer_pb2.TokenizeRequest(chat=_chat(*messages, add_generation_prompt=False))
            got = await stub.Tokenize(req)
            assert list(got.token_ids) == tokenize_chat(
                tokenizer, as_dicts, add_generation_prompt=False
            )
            assert list(got.token_ids) != tokenize_chat(tokenizer, as_dicts)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (tokenizer_pb2.TokenizeRequest(), "input"),
        (tokenizer_pb2.TokenizeRequest(text=""), "text"),
        (tokenizer_pb2.TokenizeRequest(chat=_chat()), "chat.messages"),
        (tokenizer_pb2.TokenizeRequest(chat=_chat(("robot", "hi"))), "chat.messages[0].role"),
        (
            tokenizer_pb2.TokenizeRequest(chat=_chat(("user", "hi"), ("boss", "x"))),
            "chat.messages[1].role",
        ),
    ],
)
def test_tokenize_errors_name_the_field(tokenizer, request_, field):
    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Tokenize(request_)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(f"{field}: ")

    asyncio.run(body())


# ---- Detokenize ---------------------------------------------------------------------------


def _open(
    sid: int = 1, prompt: Sequence[int] = (), stop: Sequence[str] = (), include: bool = False
) -> tokenizer_pb2.DetokenizeOpen:
    return tokenizer_pb2.DetokenizeOpen(
        sequence_id=sid, prompt_token_ids=list(prompt), stop=list(stop),
        include_stop_str_in_output=include,
    )  # fmt: skip


def _feed(sid: int, ids: Sequence[int], finished: bool = False) -> tokenizer_pb2.DetokenizeFeed:
    return tokenizer_pb2.DetokenizeFeed(sequence_id=sid, token_ids=list(ids), finished=finished)


async def _stream(
    stub: tokenizer_pb2_grpc.TokenizerStub, requests: list[tokenizer_pb2.DetokenizeRequest]
) -> list[list[tokenizer_pb2.DetokenizedText]]:
    async def gen() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        for r in requests:
            yield r

    return [list(r.texts) async for r in stub.Detokenize(gen())]


async def _detokenize(
    stub: tokenizer_pb2_grpc.TokenizerStub,
    op: tokenizer_pb2.DetokenizeOpen,
    chunks: list[list[int]],
    *,
    finish: bool,
) -> list[tuple[str, str]]:
    """One sequence alone on a stream: (text, stop string) per chunk."""
    requests = [tokenizer_pb2.DetokenizeRequest(opens=[op])]
    for i, chunk in enumerate(chunks):
        feed = _feed(op.sequence_id, chunk, finished=finish and i == len(chunks) - 1)
        requests.append(tokenizer_pb2.DetokenizeRequest(feeds=[feed]))
    return [(t.text, t.stop_string) for [t] in await _stream(stub, requests)]


def _reference(
    tokenizer: Any,
    prompt: list[int],
    chunks: list[list[int]],
    stop: Sequence[str],
    include: bool,
    *,
    finish: bool,
) -> list[tuple[str, str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop, include_stop_str_in_output=include)
    out = []
    for i, chunk in enumerate(chunks):
        text = detok.add_tokens(chunk)
        if finish and i == len(chunks) - 1:
            text += detok.finish()
        out.append((text, detok.stop_reason or ""))
    return out


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    ("stop", "include"), [((), False), (("STOP",), False), (("STOP", "lazy"), True)]
)
def test_detokenize_stream_equals_incremental_detokenizer(tokenizer, chunk, stop, include):
    prompt = tokenize_chat(tokenizer, [{"role": "user", "content": "Say something."}])
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]

    async def body() -> list[tuple[str, str]]:
        async with serving(tokenizer) as (stub, _):
            return await _detokenize(stub, _open(1, prompt, stop, include), chunks, finish=True)

    got = asyncio.run(body())
    want = _reference(tokenizer, prompt, chunks, stop, include, finish=True)
    assert got == want
    assert len(got) == len(chunks)  # one answer per feed
    text = "".join(t for t, _ in got)
    if not stop:
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert all(s == "" for _, s in got)
    else:
        first = stop[0] if TEXT.find(stop[0]) < TEXT.find(stop[-1]) else stop[-1]
        assert text.endswith(first) == include
        assert got[-1][1] == first  # sticky once matched


def test_many_sequences_share_one_stream(tokenizer):
    """Interleaved sequences, fed in batches, each get the text they would get alone; only
    requests that feed are answered, one text per feed in feed order."""
    texts = ["The quick brown fox.", "Hello world, again and again.", "Numbers: 1, 22, 333."]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    stops = [(), ("again",), ()]
    steps = max(len(x) for x in ids)
    requests = [
        tokenizer_pb2.DetokenizeRequest(opens=[_open(10 + i, stop=stops[i]) for i in range(3)])
    ]
    for s in range(steps):
        feeds = [
            _feed(10 + i, [x[s]], finished=s == len(x) - 1) for i, x in enumerate(ids) if s < len(x)
        ]
        requests.append(tokenizer_pb2.DetokenizeRequest(feeds=feeds[::-1]))  # any order
    requests.append(tokenizer_pb2.DetokenizeRequest(closes=[10, 11, 12]))  # not answered

    async def body():
        async with serving(tokenizer) as (stub, _):
            return await _stream(stub, requests)

    answers = asyncio.run(body())
    assert len(answers) == steps
    for i, x in enumerate(ids):
        got = [t for step in answers for t in step if t.sequence_id == 10 + i]
        want = _reference(tokenizer, [], [[t] for t in x], stops[i], False, finish=True)
        assert [(t.text, t.stop_string) for t in got] == want
        assert not any(t.error for t in got)
    for step, request in zip(answers, requests[1:], strict=False):
        assert [t.sequence_id for t in step] == [f.sequence_id for f in request.feeds]


def test_finished_flushes_held_back_text(tokenizer):
    ids = tokenizer.encode("Hello ST", add_special_tokens=False)

    async def body() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        async with serving(tokenizer) as (stub, _):
            held = await _detokenize(stub, _open(stop=["STOP"]), [ids], finish=False)
            flushed = await _detokenize(stub, _open(stop=["STOP"]), [ids], finish=True)
            return held, flushed

    held, flushed = asyncio.run(body())
    assert held == [("Hello ", "")]  # "ST" might still become "STOP"
    assert flushed == [("Hello ST", "")]


def test_ids_past_the_tokenizer_vocabulary_decode_to_nothing(tokenizer):
    """A model's padded vocabulary rows (ids >= len(tokenizer)) can be sampled; they have no
    text, and the text around them is unchanged."""
    hello = tokenizer.encode("Hello world", add_special_tokens=False)
    padded = [hello[0], len(tokenizer), len(tokenizer) + 7, *hello[1:]]

    async def body() -> list[tuple[str, str]]:
        async with serving(tokenizer) as (stub, _):
            return await _detokenize(stub, _open(), [padded], finish=True)

    assert "".join(text for text, _ in asyncio.run(body())) == "Hello world"


@pytest.mark.parametrize(
    ("opens", "feeds", "field"),
    [
        ([], [_feed(1, [5])], "feeds.sequence_id"),  # never opened
        ([_open(1), _open(1)], [_feed(1, [5])], "opens.sequence_id"),  # opened twice
        ([_open(1)], [_feed(1, [5, -3])], "feeds.token_ids[1]"),
        ([_open(1, prompt=[-1])], [_feed(1, [5])], "opens.prompt_token_ids[0]"),
        ([_open(1, stop=["ok", ""])], [_feed(1, [5])], "opens.stop[1]"),
        ([_open(1)], [_feed(1, [5], finished=True), _feed(1, [6])], "feeds.sequence_id"),
    ],
)
def test_a_bad_sequence_fails_alone_naming_the_field(tokenizer, opens, feeds, field):
    """The bad sequence's answer carries the error; a good sequence on the same stream, fed in
    the same requests, is answered as usual."""
    good = _open(99)
    requests = [
        tokenizer_pb2.DetokenizeRequest(opens=[*opens, good]),
        *[tokenizer_pb2.DetokenizeRequest(feeds=[f, _feed(99, [42])]) for f in feeds],
    ]

    async def body():
        async with serving(tokenizer) as (stub, _):
            return await _stream(stub, requests)

    answers = asyncio.run(body())
    bad = answers[-1][0]
    assert bad.error.startswith(f"{field}: ") and bad.text == ""
    assert all(not step[1].error for step in answers)


def test_latency_histogram_counts_each_request(tokenizer):
    name = "llmfleet:tokenizer_latency_seconds_count"

    def count(op: str) -> float:
        return prometheus_client.REGISTRY.get_sample_value(name, {"op": op}) or 0.0

    before = count("tokenize"), count("detokenize")

    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))
            await _detokenize(stub, _open(), [[1, 2], [3]], finish=True)

    asyncio.run(body())
    assert count("tokenize") == before[0] + 1
    assert count("detokenize") == before[1] + 3  # the open, then two feeds


# ---- health and lifecycle -----------------------------------------------------------------


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return resp.status


def test_health_is_serving_once_loaded(tokenizer):
    async def body() -> None:
        async with serving(tokenizer) as (_, address):
            assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
            status = await _health(address, "llmfleet.v1.Tokenizer")
            assert status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(body())


def test_not_serving_and_unavailable_before_the_tokenizer_is_set(tokenizer):
    async def body() -> None:
        svc = Service("tokenizer", "127.0.0.1", 0)
        servicer = TokenizerServicer()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, svc.server)
        await svc.start(["llmfleet.v1.Tokenizer"])
        try:
            assert await _health(svc.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                servicer.set_tokenizer(tokenizer)
                await svc.set_serving()
                got = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"))
                assert list(got.token_ids) == tokenize_prompt(tokenizer, "hi")
        finally:
            svc.request_stop()
            await svc.wait_for_termination()

    asyncio.run(body())


def _health_sync(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None


def test_process_comes_up_serving_and_exits_0_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmfleet.services.tokenizer", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    try:
        address, log = None, []
        deadline = time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(log)
                continue
            log.append(line)
            m = re.search(r"tokenizer listening on (\S+:\d+)", line)
            address = m.group(1) if m else None
        assert address is not None, "".join(log)
        while _health_sync(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            time.sleep(0.1)
        with grpc.insecure_channel(address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            assert list(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi")).token_ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout.read() == ""  # services print nothing to stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_process_with_a_bad_model_path_exits_1_with_the_reason(tmp_path):
    missing = tmp_path / "nope.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmfleet.services.tokenizer",
            "--port",
            "0",
            "--model",
            str(missing),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_process_with_a_bad_flag_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "llmfleet.services.tokenizer", "--port", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--port" in proc.stderr
