"""The OpenAI HTTP backend and the request driver against a scripted SSE server in-process.

The fake server (aiohttp.web on 127.0.0.1:0, same event loop) streams `max_tokens` one-token
events 5 ms apart, then a usage event and `data: [DONE]`, as an OpenAI-compatible server does
with `stream_options.include_usage`; prompt "bad" gets a 400 in OpenAI's error shape, prompt
"nousage" a stream without the usage event.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from llmfleet.cli.benchserve.backends import OpenAIBackend
from llmfleet.cli.benchserve.datasets import SampleRequest
from llmfleet.cli.benchserve.runner import run_requests
from llmfleet.cli.benchserve.stats import RequestRecord

pytestmark = pytest.mark.timeout(60)
GAP_S = 0.005


class FakeOpenAI:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt == "bad":
            error = {"message": "max_tokens: must be >= 1", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        n = body.get("max_completion_tokens") or body.get("max_tokens")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

        async def event(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            if chat:  # a role-only first chunk carries no token
                await event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                await asyncio.sleep(GAP_S)
                piece = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
                await event({"choices": [{"index": 0, **piece}]})
            if prompt != "nousage":
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                await event({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp


def serve(test: Callable[[str, FakeOpenAI], Awaitable[None]]) -> FakeOpenAI:
    fake = FakeOpenAI()

    async def main() -> None:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            await test(f"http://127.0.0.1:{port}", fake)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return fake


async def send_one(backend: OpenAIBackend, prompt: str, out_len: int) -> RequestRecord:
    record = RequestRecord(0, 0, out_len)
    await backend.send(SampleRequest(prompt, 0, out_len), record, 0.0)
    return record


@pytest.mark.parametrize("chat", [False, True])
def test_stream_is_timed_per_token_and_usage_counts(chat):
    async def test(url: str, fake: FakeOpenAI) -> None:
        backend = OpenAIBackend(url, chat=chat)
        try:
            assert await backend.model_id() == "fake-model"
            r = await send_one(backend, "hello", 6)
        finally:
            await backend.close()
        assert r.success, r.error
        assert r.output_tokens == 6 and r.prompt_len == 3
        assert len(r.itl_s) == 5  # six token chunks; the role-only chunk is not one
        assert all(g >= GAP_S * 0.5 for g in r.itl_s)
        assert r.ttft_s >= GAP_S * 0.5 and r.latency_s >= r.ttft_s + sum(r.itl_s)

    fake = serve(test)
    [body] = fake.bodies
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_completion_tokens" if chat else "max_tokens"] == 6


def test_http_errors_and_missing_usage_are_failed_records():
    async def test(url: str, fake: FakeOpenAI) -> None:
        backend = OpenAIBackend(url, chat=False, model="fake-model")
        try:
            bad = await send_one(backend, "bad", 2)
            nousage = await send_one(backend, "nousage", 2)
        finally:
            await backend.close()
        assert not bad.success and bad.error.startswith("HTTP 400:")
        assert "max_tokens: must be >= 1" in bad.error
        assert not nousage.success and "without usage" in nousage.error

        unreachable = OpenAIBackend("http://127.0.0.1:9", chat=False, model="m")
        try:
            down = await send_one(unreachable, "hello", 2)
        finally:
            await unreachable.close()
        assert not down.success and "ClientConnectorError" in down.error

    serve(test)


def test_run_requests_keeps_max_concurrency_and_the_arrival_schedule():
    requests = [SampleRequest(f"p{i}", 2, 4) for i in range(6)]
    times = [0.0, 0.0, 0.0, 0.0, 0.2, 0.2]

    async def test(url: str, fake: FakeOpenAI) -> None:
        backend = OpenAIBackend(url, chat=False, max_connections=2)
        await backend.model_id()
        try:
            records, duration = await run_requests(
                backend, requests, times, max_concurrency=2, disable_tqdm=True
            )
        finally:
            await backend.close()
        assert fake.peak_in_flight == 2
        assert [r.index for r in records] == list(range(6)) and all(r.success for r in records)
        assert sum(r.output_tokens for r in records) == 24
        assert all(r.scheduled_s >= 0.2 for r in records[4:])
        waited = [r for r in records if r.start_s - r.scheduled_s > 2 * GAP_S]
        assert waited  # some requests queued for a slot
        assert duration >= max(r.end_s for r in records)

    serve(test)


def test_first_request_after_a_long_dataset_build_survives_the_keep_alive_timeout():
    """The model probe's connection is not kept: building the dataset after it (its event loop
    busy, as here) can outlast the server's keep-alive timeout, and the first request must not
    be written to a connection the server has closed."""
    fake = FakeOpenAI()
    started = threading.Event()
    stop: list[Callable[[], None]] = []
    ports: list[int] = []

    def server() -> None:  # its own thread and loop: it closes idle connections meanwhile
        async def main() -> None:
            runner = web.AppRunner(fake.app(), keepalive_timeout=0.1)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            stop.append(lambda: loop.call_soon_threadsafe(done.set))
            started.set()
            await done.wait()
            await runner.cleanup()

        asyncio.run(main())

    thread = threading.Thread(target=server)
    thread.start()
    try:
        assert started.wait(10)

        async def client() -> list[RequestRecord]:
            backend = OpenAIBackend(f"http://127.0.0.1:{ports[0]}", chat=True)
            try:
                assert await backend.model() == ("fake-model", None)
                time.sleep(0.5)  # building the dataset holds the loop
                return [await send_one(backend, f"p{i}", 2) for i in range(2)]
            finally:
                await backend.close()

        records = asyncio.run(client())
    finally:
        stop[0]()
        thread.join(10)
    assert [(r.success, r.error) for r in records] == [(True, "")] * 2
