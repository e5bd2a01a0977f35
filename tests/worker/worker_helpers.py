"""Helpers for in-process worker tests: start workers, collect TokenBatches, reference tokens."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import torch
import zmq
import zmq.asyncio

from llmfleet.engine.engine import LLMEngine
from llmfleet.services.worker.server import WorkerServer, serve
from llmfleet.shared.core.config import EngineConfig, WorkerConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.convert import sampling_to_pb
from llmfleet.shared.wire.transport import bind
from llmfleet.v1 import dataplane_pb2, worker_pb2, worker_pb2_grpc

BS = 4
ENGINE = dict(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=64)


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **kw})


async def start_worker(loaded, role="unified", engine_kw=None, **worker_kw) -> WorkerServer:
    wc = WorkerConfig(role=role, **worker_kw)
    return await serve(wc, engine_config(**(engine_kw or {})), loaded, grace_s=2.0)


def run(coro, timeout: float = 60.0):
    """Run a test's coroutine in a fresh event loop, failing it after `timeout` seconds."""

    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def stub(server_or_address) -> worker_pb2_grpc.WorkerStub:
    address = getattr(server_or_address, "address", server_or_address)
    return worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(address))


def prompt(loaded, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, loaded.spec.vocab_size, (n,), generator=g).tolist()


def reference_tokens(loaded, ids: list[int], params: SamplingParams) -> dict[int, list[int]]:
    """Tokens per completion index from a plain in-process engine."""
    engine = LLMEngine(engine_config(), loaded)
    engine.add_request("ref", ids, params)
    out: dict[int, list[int]] = defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.index].extend(o.new_token_ids)
    return dict(out)


def add_request_pb(rid, ids, params, endpoint, salt="") -> worker_pb2.AddRequestRequest:
    return worker_pb2.AddRequestRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=sampling_to_pb(params),
        cache_salt=salt,
        reply_endpoint=endpoint,
    )


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    finish_reason: int = 0
    num_cached_tokens: int = 0


class Replies:
    """A router's reply endpoint: a PULL socket collecting TokenBatch outputs."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock, self.endpoint = bind(ctx, zmq.PULL, "127.0.0.1")
        self.completions: dict[tuple[str, int], Completion] = defaultdict(Completion)
        self.batches: list[dataplane_pb2.TokenBatch] = []

    async def next_batch(self, timeout: float = 20.0) -> dataplane_pb2.TokenBatch:
        raw = await asyncio.wait_for(self.sock.recv(), timeout)
        batch = dataplane_pb2.TokenBatch.FromString(raw)
        self.batches.append(batch)
        for out in batch.outputs:
            c = self.completions[(out.request_id, out.index)]
            c.tokens.extend(out.token_ids)
            c.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason:
                c.finish_reason = out.finish_reason
        return batch

    async def until_finished(self, rid: str, n: int = 1, timeout: float = 30.0):
        async with asyncio.timeout(timeout):
            while not all(self.completions[(rid, i)].finish_reason for i in range(n)):
                await self.next_batch()
        return [self.completions[(rid, i)] for i in range(n)]

    def close(self) -> None:
        self.sock.close(linger=0)


async def stats(server) -> worker_pb2.GetWorkerStatsResponse:
    return await stub(server).GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
