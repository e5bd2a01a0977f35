"""An in-process router with a fake tokenizer and fake workers, for servicer tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from fakes import FakeTokenizer, FakeWorker

from llmfleet.services.router.server import RouterServer
from llmfleet.shared.core.config import RouterConfig
from llmfleet.v1 import common_pb2, generation_pb2, generation_pb2_grpc

TEST_TIMEOUT_S = 30.0


def run(coro: Awaitable[Any]) -> Any:
    """Run an async test body with a hard time bound."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, TEST_TIMEOUT_S)

    return asyncio.run(bounded())


async def eventually(cond: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.01)


class Fleet:
    def __init__(self, **config: Any) -> None:
        defaults: dict[str, Any] = dict(
            port=0,
            heartbeat_interval_ms=50,
            heartbeat_timeout_ms=1000,  # 400 expired a live worker once in a loaded CI run
            routing_policy="round_robin",
        )
        defaults.update(config)
        self.config_kwargs = defaults
        self.tokenizer = FakeTokenizer()
        self.workers: list[FakeWorker] = []
        self.server: RouterServer | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: generation_pb2_grpc.GenerationStub | None = None

    async def __aenter__(self) -> Fleet:
        await self.tokenizer.start()
        await self.start_router()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.workers:
            await w.stop()
        await self.stop_router()
        await self.tokenizer.stop()

    @property
    def router(self):
        return self.server.router

    async def start_router(self, port: int = 0) -> None:
        cfg = RouterConfig(
            tokenizer_address=self.tokenizer.address, **{**self.config_kwargs, "port": port}
        )
        self.server = RouterServer(cfg, expose_metrics=False)
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def stop_router(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop()

    async def add_worker(self, worker_id: str, role: str = "unified", **kw: Any) -> FakeWorker:
        w = FakeWorker(worker_id, role, **kw)
        await w.start()
        self.workers.append(w)
        w.start_heartbeats(self.server.address)
        await eventually(lambda: self.router.registry.is_live(worker_id), what=f"{worker_id} live")
        await eventually(
            lambda: not self.router.kv.index.is_stale(worker_id), what=f"{worker_id} synced"
        )
        return w

    async def generate(self, **req: Any) -> tuple[list[generation_pb2.GenerateResponse], str]:
        """All responses of one Generate call and the text of completion 0."""
        out = [r async for r in self.stub.Generate(generation_pb2.GenerateRequest(**req))]
        return out, text_of(out, 0)


async def read_rest(call: Any) -> list[generation_pb2.GenerateResponse]:
    """The remaining responses of a call already read with `read()`."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def text_of(responses: list[generation_pb2.GenerateResponse], index: int) -> str:
    return "".join(d.text for r in responses for d in r.deltas if d.index == index)


def tokens_of(responses: list[generation_pb2.GenerateResponse], index: int) -> list[int]:
    return [t for r in responses for d in r.deltas if d.index == index for t in d.token_ids]


def finish_of(responses: list[generation_pb2.GenerateResponse], index: int) -> Any:
    ends = [d for r in responses for d in r.deltas if d.index == index and d.finish_reason]
    assert len(ends) == 1, ends
    return ends[0]


def sampling(**kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def letters(start: int, count: int, index: int = 0) -> str:
    return "".join(chr(97 + (p + index) % 26) for p in range(start, start + count))
