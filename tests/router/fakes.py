"""Small in-process fakes of the router's peers, speaking the real wire contract.

- `FakeTokenizer`: byte-level. Tokenize: text -> its UTF-8 bytes as ids (chat: "role: content\\n"
  per message). Detokenize: many sequences per stream, ids -> bytes -> text, stop strings applied
  (text held back while it could still grow into one), one response per request with feeds.
- `FakeWorker`: a grpc.aio Worker servicer with a deterministic "model": the token at absolute
  position p of completion i is the letter `chr(97 + (p + i) % 26)`, so a request re-submitted
  with prompt + streamed tokens continues exactly where it stopped. It pushes one TokenBatch per
  step to the reply endpoint, publishes KV events for the prompt's full blocks, answers
  snapshots, implements the lease RPCs, registers and heartbeats like a real worker, and records
  every RPC it receives in `calls` (in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.wire.kv_events import KVEventPublisher
from llmfleet.v1 import (
    common_pb2,
    dataplane_pb2,
    registry_pb2,
    registry_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

MODEL_ID = "fake-model"
BLOCK_SIZE = 4
MODEL = common_pb2.ModelInfo(
    model_id=MODEL_ID,
    architecture="FakeForCausalLM",
    vocab_size=300,
    max_model_len=256,
    eos_token_ids=[256],
    max_n=4,
    max_logprobs=5,
    block_size=BLOCK_SIZE,
)
ROLES = {
    "unified": common_pb2.WORKER_ROLE_UNIFIED,
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}


def letter(pos: int, index: int = 0) -> int:
    return 97 + (pos + index) % 26


def prompt_hashes(ids: list[int], salt: str = "") -> list[bytes]:
    return hash_block_chain(ids, BLOCK_SIZE, HashContext(MODEL_ID, salt))


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self, self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = ""
        self.detokenize_requests: list[tokenizer_pb2.DetokenizeRequest] = []  # every stream's

    async def start(self, port: int = 0) -> None:
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.address = f"127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.server.stop(0)

    async def Tokenize(self, request, context):
        if request.WhichOneof("input") == "text":
            return tokenizer_pb2.TokenizeResponse(token_ids=list(request.text.encode()))
        text = ""
        for i, m in enumerate(request.chat.messages):
            if m.role not in ("system", "user", "assistant", "tool"):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chat.messages[{i}].role: must be a known role, got {m.role!r}",
                )
            text += f"{m.role}: {m.content}\n"
        return tokenizer_pb2.TokenizeResponse(token_ids=list(text.encode()))

    async def Detokenize(
        self, request_iterator, context
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        sequences: dict[int, _ByteSequence] = {}
        async for req in request_iterator:
            self.detokenize_requests.append(req)
            for op in req.opens:
                sequences[op.sequence_id] = _ByteSequence(
                    list(op.stop), op.include_stop_str_in_output
                )
            if req.feeds:
                resp = tokenizer_pb2.DetokenizeResponse()
                for feed in req.feeds:
                    seq = sequences.get(feed.sequence_id)
                    if seq is None:
                        resp.texts.add(sequence_id=feed.sequence_id, error="not open")
                        continue
                    text = seq.add(feed.token_ids, feed.finished)
                    resp.texts.add(
                        sequence_id=feed.sequence_id, text=text, stop_string=seq.stop_hit,
                        num_tokens=seq.used if seq.stop_hit else 0,
                    )  # fmt: skip
                    if feed.finished:
                        del sequences[feed.sequence_id]
                yield resp
            for sid in req.closes:
                sequences.pop(sid, None)


class _ByteSequence:
    """One sequence of FakeTokenizer.Detokenize: bytes to text, stop strings held back."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops, self.include = stops, include
        self.data = b""
        self.emitted = 0
        self.stop_hit = ""
        self.used = 0  # with stop_hit: the tokens of the last feed up to the stop's end (ASCII)

    def add(self, token_ids, finished: bool) -> str:
        if self.stop_hit:
            return ""
        before = len(self.data)
        self.data += bytes(t for t in token_ids if t < 256)
        text = self.data.decode("utf-8", errors="ignore")
        cut = len(text)
        for s in self.stops:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at >= 0 and (not self.stop_hit or at < cut):
                self.stop_hit, cut = s, at + (len(s) if self.include else 0)
                self.used = at + len(s) - before
        if not self.stop_hit and not finished and self.stops:
            hold = max(len(s) - 1 for s in self.stops)
            cut = max(self.emitted, len(text) - hold)
        out = text[self.emitted : cut] if cut > self.emitted else ""
        self.emitted = max(self.emitted, cut)
        return out


class _Blackhole:
    async def send(self, data: bytes) -> None:
        return None


class _Seq:
    def __init__(self, req_id: str, prompt: list[int], n: int, max_tokens: int, done: int):
        self.req_id = req_id
        self.prompt = prompt
        self.live = set(range(n))
        self.max_tokens = max_tokens
        self.generated = [done] * n  # tokens generated so far per completion (incl. first)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, worker_id: str, role: str = "unified", *, step_s: float = 0.004, prefill_failures=0
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.step_s = step_s
        self.prefill_failures = prefill_failures
        self.prefill_gate: asyncio.Event | None = None
        self.calls: list[tuple[str, object]] = []
        self.load = common_pb2.LoadReport(num_free_blocks=100, num_total_blocks=100)
        self.num_snapshots = 0
        self.ctx = zmq.asyncio.Context()
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        self.publisher: KVEventPublisher | None = None
        self.address = ""
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._seqs: dict[str, _Seq] = {}
        self._tasks: set[asyncio.Task] = set()
        self._hb: asyncio.Task | None = None
        self.registrations = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.publisher = KVEventPublisher(self.ctx, "127.0.0.1", self.worker_id)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def requests(self, name: str) -> list:
        return [req for n, req in self.calls if n == name]

    async def register(self, router: str) -> None:
        async with grpc.aio.insecure_channel(router) as ch:
            await registry_pb2_grpc.RegistryStub(ch).RegisterWorker(self._registration())
        self.registrations += 1

    def start_heartbeats(self, router: str, period_s: float = 0.05) -> None:
        self._hb = asyncio.create_task(self._heartbeats(router, period_s))

    def stop_heartbeats(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
            self._hb = None

    async def kill(self) -> None:
        """Die: no more heartbeats, outputs or RPC answers."""
        self.stop_heartbeats()
        for t in list(self._tasks):
            t.cancel()
        await self.server.stop(0)

    async def stop(self) -> None:
        await self.kill()
        for s in self._push.values():
            s.close(linger=0)
        if self.publisher is not None:
            self.publisher.close()
        self.ctx.term()

    def _registration(self) -> registry_pb2.RegisterWorkerRequest:
        return registry_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id,
            role=ROLES[self.role],
            address=self.address,
            kv_events_endpoint=self.publisher.endpoint,
            model=MODEL,
            load=self.load,
        )

    async def _heartbeats(self, router: str, period_s: float) -> None:
        async with grpc.aio.insecure_channel(router) as ch:
            stub = registry_pb2_grpc.RegistryStub(ch)
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    resp = await stub.Heartbeat(
                        registry_pb2.HeartbeatRequest(worker_id=self.worker_id, load=self.load),
                        timeout=1,
                    )
                    if not resp.known:
                        await stub.RegisterWorker(self._registration(), timeout=1)
                        self.registrations += 1
                await asyncio.sleep(period_s)

    # -- generation -----------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _sock(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    async def _generate(self, seq: _Seq, endpoint: str, cached: int) -> None:
        sock = self._sock(endpoint)
        step = 0
        while seq.live:
            await asyncio.sleep(self.step_s)
            step += 1
            batch = dataplane_pb2.TokenBatch(worker_id=self.worker_id, step=step)
            for i in sorted(seq.live):
                pos = len(seq.prompt) + seq.generated[i]
                seq.generated[i] += 1
                out = batch.outputs.add(
                    request_id=seq.req_id,
                    index=i,
                    token_ids=[letter(pos, i)],
                    num_prompt_tokens=len(seq.prompt),
                    num_cached_tokens=cached,
                )
                if seq.generated[i] >= seq.max_tokens:
                    out.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    seq.live.discard(i)
            await sock.send(batch.SerializeToString())
        self._seqs.pop(seq.req_id, None)

    async def _announce(self, prompt: list[int], salt: str) -> int:
        """Publish the prompt's full blocks as cached; returns how many tokens were cached."""
        hashes = prompt_hashes(prompt, salt)
        held_set = set(self.publisher.snapshot().block_hashes)
        cached = 0
        for h in hashes:
            if h not in held_set:
                break
            cached += BLOCK_SIZE
        await self.publisher.publish(stored=[h for h in hashes if h not in held_set])
        return cached

    async def publish(self, stored: list[bytes], *, lost: bool = False) -> None:
        """Publish a KV event; `lost`: it takes a seq number but never reaches subscribers."""
        real = self.publisher.sock
        if lost:
            self.publisher.sock = _Blackhole()
        try:
            await self.publisher.publish(stored=stored)
        finally:
            self.publisher.sock = real

    async def AddRequest(self, request, context):
        self.calls.append(("AddRequest", request))
        prompt = list(request.prompt_token_ids)
        cached = await self._announce(prompt, request.cache_salt)
        seq = _Seq(
            request.request_id, prompt, request.sampling.n or 1, request.sampling.max_tokens, 0
        )
        self._seqs[request.request_id] = seq
        self._spawn(self._generate(seq, request.reply_endpoint, cached))
        return worker_pb2.AddRequestResponse(num_cached_tokens=cached)

    async def Cancel(self, request, context):
        self.calls.append(("Cancel", request))
        seq = self._seqs.get(request.request_id)
        if seq is None:
            return worker_pb2.CancelResponse(found=False)
        if request.HasField("index"):
            seq.live.discard(request.index)
        else:
            seq.live.clear()
        return worker_pb2.CancelResponse(found=True)

    async def GetWorkerStats(self, request, context):
        return worker_pb2.GetWorkerStatsResponse(worker_id=self.worker_id, load=self.load)

    async def GetKVSnapshot(self, request, context):
        self.num_snapshots += 1
        snap = self.publisher.snapshot()
        return worker_pb2.GetKVSnapshotResponse(
            publisher_id=self.worker_id,
            seq=snap.seq,
            block_hashes=snap.block_hashes,
            epoch=snap.epoch,
        )

    async def ReserveKV(self, request, context):
        self.calls.append(("ReserveKV", request))
        return worker_pb2.ReserveKVResponse(
            lease=worker_pb2.KVLease(
                lease_id=uuid.uuid4().hex,
                epoch=1,
                expires_at_unix_ms=2**40,
                kv_endpoint="tcp://127.0.0.1:1",
                num_blocks=-(-request.num_prompt_tokens // BLOCK_SIZE),
            )
        )

    async def Prefill(self, request, context):
        self.calls.append(("Prefill", request))
        if self.prefill_gate is not None:  # a test holds the prefill in flight
            await self.prefill_gate.wait()
        if self.prefill_failures > 0:
            self.prefill_failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv push to the decode worker failed")
        prompt = list(request.prompt_token_ids)
        cached = await self._announce(prompt, request.cache_salt)
        return worker_pb2.PrefillResponse(
            first_token_id=letter(len(prompt)),
            num_cached_tokens=cached,
            finished=request.sampling.max_tokens == 1,
        )

    async def StartDecode(self, request, context):
        self.calls.append(("StartDecode", request))
        prompt = list(request.prompt_token_ids)
        seq = _Seq(request.request_id, prompt, 1, request.sampling.max_tokens, 1)
        self._seqs[request.request_id] = seq
        self._spawn(self._generate(seq, request.reply_endpoint, 0))
        return worker_pb2.StartDecodeResponse()

    async def ReleaseKV(self, request, context):
        self.calls.append(("ReleaseKV", request))
        return worker_pb2.ReleaseKVResponse(released=True)
