"""The tokenizer service: in-process over loopback gRPC, and as a real process.

Results must equal the core functions it wraps (tokenize_prompt, tokenize_chat) for the bundled
SmolLM2 tokenizer; the Detokenize stream is in test_detokenize.py.
"""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.services.tokenizer.server import TokenizerServicer
from llmfleet.shared.wire.service import Service
from llmfleet.text.chat import tokenize_chat, tokenize_prompt
from llmfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .service_helpers import TEXT, serving

pytestmark = pytest.mark.timeout(120)


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
