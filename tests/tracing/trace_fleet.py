"""Every service of a fleet in this process (one event loop, loopback sockets), and span queries.

async with InProcessFleet(loaded, mode="aggregated", roles=("unified", "unified")) as fleet:
    result = await fleet.client.generate("hi", max_tokens=4)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmfleet.client.generation import AsyncGenerationClient
from llmfleet.models.loader import LoadedModel
from llmfleet.services.kvstore.server import serve as serve_kvstore
from llmfleet.services.router.server import RouterServer
from llmfleet.services.tokenizer.server import start as start_tokenizer
from llmfleet.services.worker.server import WorkerServer
from llmfleet.services.worker.server import serve as serve_worker
from llmfleet.shared.core.config import (
    EngineConfig,
    KVStoreConfig,
    RouterConfig,
    TokenizerConfig,
    WorkerConfig,
)

ENGINE = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)


class InProcessFleet:
    def __init__(
        self, loaded: LoadedModel, *, mode: str, roles: Sequence[str], **router: Any
    ) -> None:
        self.loaded = loaded
        self.mode = mode
        self.roles = roles
        self.router_kw = router
        self.workers: list[WorkerServer] = []

    async def __aenter__(self) -> InProcessFleet:
        self.kvstore = await serve_kvstore(KVStoreConfig(metrics_port=None, ram_bytes=64 << 20))
        self.tokenizer = await start_tokenizer(
            TokenizerConfig(metrics_port=None), tokenizer=self.loaded.tokenizer
        )
        config = RouterConfig(
            port=0,
            tokenizer_address=self.tokenizer.address,
            mode=self.mode,
            heartbeat_interval_ms=50,
            heartbeat_timeout_ms=2000,
            **self.router_kw,
        )
        self.router = RouterServer(config, expose_metrics=False)
        await self.router.start()
        for i, role in enumerate(self.roles):
            wc = WorkerConfig(
                role=role,
                worker_id=f"{role}-{i}",
                metrics_port=None,
                router_address=self.router.address,
                kvstore_address=self.kvstore.address,
                kvstore_endpoint=self.kvstore.data_endpoint,
            )
            ec = EngineConfig(**ENGINE)
            self.workers.append(await serve_worker(wc, ec, self.loaded, grace_s=1.0))
        self.client = AsyncGenerationClient(self.router.address)
        registry = self.router.router.registry
        await until(
            lambda: (
                self.router.serving and all(registry.is_live(w.worker_id) for w in self.workers)
            ),
            what="router SERVING with every worker live",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        for w in self.workers:
            await w.stop(grace_s=0)
        await self.router.stop()
        self.tokenizer.request_stop()
        await self.tokenizer.wait_for_termination()
        await self.kvstore.stop(0)

    @property
    def addresses(self) -> list[str]:
        return [
            self.kvstore.address,
            self.tokenizer.address,
            self.router.address,
            *(w.address for w in self.workers),
        ]

    async def health_checks(self, metadata: tuple[tuple[str, str], ...] | None) -> None:
        """One Check and one Watch update from every service, with the given metadata."""
        for address in self.addresses:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                resp = await stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, address
                watch = stub.Watch(health_pb2.HealthCheckRequest(), metadata=metadata)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()


async def until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.01)


class Trace:
    """The finished spans of one trace, by name, with parent/child lookups."""

    def __init__(self, spans: Iterable[ReadableSpan]) -> None:
        self.spans = list(spans)
        self.by_id = {s.context.span_id: s for s in self.spans}

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r}: {self.names()}"
        return found[0]

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        return self.by_id.get(span.parent.span_id) if span.parent is not None else None

    def children(self, span: ReadableSpan, name: str) -> list[ReadableSpan]:
        return [s for s in self.named(name) if self.parent(s) is span]

    def child(self, span: ReadableSpan, name: str) -> ReadableSpan:
        found = self.children(span, name)
        assert len(found) == 1, f"{len(found)} {name!r} under {span.name!r}: {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(s.name for s in self.spans)


def trace_of(
    source: InMemorySpanExporter | Sequence[ReadableSpan], root_name: str = "llm_request"
) -> list[Trace]:
    """The finished traces rooted at a `root_name` span, oldest first (`source`: an exporter,
    or one snapshot of its spans)."""
    spans = source.get_finished_spans() if isinstance(source, InMemorySpanExporter) else source
    roots = [s for s in spans if s.name == root_name]
    return [Trace(s for s in spans if s.context.trace_id == r.context.trace_id) for r in roots]


def text_values(span: ReadableSpan) -> list[str]:
    """Every string in a span's attributes and its events' attributes."""
    out: list[str] = [span.name]
    sources = [span.attributes or {}, *((e.attributes or {}) for e in span.events)]
    for attrs in sources:
        for value in attrs.values():
            values = value if isinstance(value, tuple) else (value,)
            out.extend(str(v) for v in values)
    return out
