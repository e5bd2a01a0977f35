"""Client of the kvstore, as workers use it: Lookup over gRPC, put/get over the ZMQ data plane.

    client = KVStoreClient("127.0.0.1:50060", "tcp://127.0.0.1:50061")
    n = await client.lookup(layout, hashes)               # longest held prefix
    frames = await client.get(layout, hashes[:n])         # memoryviews, one per block, in order
    blocks = [frame_tensor(f, dtype, shape) for f in frames]
    stored = await client.put(layout, hashes, [tensor_frame(b) for b in blocks])
    await client.close()

One DEALER socket carries every put/get; replies are matched to calls by `seq`, so concurrent
calls from one event loop are safe. Every call has a timeout (`timeout_s`, per call or the
client's default): no reply in time, or a closed client, raises `Unavailable`. Put payloads are
sent without copying: the caller keeps their memory unchanged until `put` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
import zmq
import zmq.asyncio
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.core.kv_index import KVSnapshot
from llmfleet.shared.wire.dealer import SeqDealer
from llmfleet.shared.wire.limits import channel_options
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tls import FleetTLS, aio_channel, zmq_context
from llmfleet.shared.wire.tracing import child_span, metadata, traceparent
from llmfleet.shared.wire.transport import Frame
from llmfleet.v1 import dataplane_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

HASH_BYTES = 32
_Reply = tuple[dataplane_pb2.KVStoreHeader, list[zmq.Frame]]


class KVStoreError(LLMFleetError):
    """The kvstore rejected a request (its reply carried `error`) or broke the protocol."""


class KVStoreClient:
    def __init__(
        self,
        address: str,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        ctx: zmq.asyncio.Context | None = None,
        tls: FleetTLS | None = None,
    ) -> None:
        """`tls`: mutual TLS on the gRPC side; the data plane is CURVE when `ctx` is a
        `tls.CurveContext` (the private context, made without `ctx`, is one with `tls`)."""
        self.address = address
        self._tls = tls
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._own_ctx = ctx is None  # a private context (Context.instance() may be a sync one)
        self._dealer: SeqDealer[dataplane_pb2.KVStoreHeader] | None = None  # made on first use
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvstore_pb2_grpc.KVStoreStub | None = None
        self._closed = False

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- API --------------------------------------------------------------------------------

    async def lookup(
        self, layout: str, hashes: Sequence[bytes], *, timeout_s: float | None = None
    ) -> int:
        """How many leading blocks of the chain `hashes` the store holds."""
        _check(layout, hashes)
        request = kvstore_pb2.LookupRequest(layout=layout, block_hashes=hashes)
        with child_span(tracer, "kvstore.lookup", kind=SpanKind.CLIENT) as span:
            response = await self._rpc("Lookup", request, timeout_s)
            span.set_attribute("llmfleet.kv.num_blocks", len(hashes))
            span.set_attribute("llmfleet.kvstore.num_matched", response.num_matched)
        return int(response.num_matched)

    async def get(
        self, layout: str, hashes: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[memoryview]:
        """The payloads of the longest held prefix of `hashes`, in order (zero-copy views)."""
        _check(layout, hashes)
        header = dataplane_pb2.KVStoreHeader(
            op=dataplane_pb2.KV_STORE_OP_GET, layout=layout, block_hashes=hashes
        )
        with child_span(tracer, "kvstore.get", kind=SpanKind.CLIENT) as span:
            header.traceparent = traceparent()
            reply, frames = await self._request(header, (), timeout_s)
            span.set_attribute("llmfleet.kv.num_blocks", len(frames))
            span.set_attribute("llmfleet.kv.bytes", sum(f.buffer.nbytes for f in frames))
        if reply.found_count != len(frames) or len(frames) > len(hashes):
            raise KVStoreError(
                f"kvstore GET reply found_count={reply.found_count} with {len(frames)} frames "
                f"for {len(hashes)} hashes"
            )
        return [f.buffer for f in frames]

    async def put(
        self,
        layout: str,
        hashes: Sequence[bytes],
        payloads: Sequence[Frame],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Store blocks (one payload frame per hash); returns how many the store now holds."""
        _check(layout, hashes)
        if len(payloads) != len(hashes):
            raise ValidationError(
                "payloads", f"{len(payloads)} payloads for {len(hashes)} block hashes"
            )
        if not hashes:
            return 0
        header = dataplane_pb2.KVStoreHeader(
            op=dataplane_pb2.KV_STORE_OP_PUT, layout=layout, block_hashes=hashes
        )
        with child_span(tracer, "kvstore.put", kind=SpanKind.CLIENT) as span:
            header.traceparent = traceparent()
            span.set_attribute("llmfleet.kv.num_blocks", len(hashes))
            span.set_attribute("llmfleet.kv.bytes", sum(memoryview(p).nbytes for p in payloads))
            reply, _ = await self._request(header, payloads, timeout_s)
        return int(reply.found_count)

    async def stats(self, *, timeout_s: float | None = None) -> kvstore_pb2.GetStoreStatsResponse:
        return await self._rpc("GetStoreStats", kvstore_pb2.GetStoreStatsRequest(), timeout_s)

    async def snapshot(self, *, timeout_s: float | None = None) -> KVSnapshot:
        """Every block hash the store holds (any layout) and the event seq it reflects."""
        resp = await self._rpc("GetKVSnapshot", worker_pb2.GetKVSnapshotRequest(), timeout_s)
        return KVSnapshot(resp.publisher_id, resp.seq, tuple(resp.block_hashes), epoch=resp.epoch)

    async def close(self) -> None:
        """Fail calls in flight with Unavailable and release the socket and channel."""
        if self._closed:
            return
        self._closed = True
        if self._dealer is not None:
            await self._dealer.close()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
        if self._channel is not None:
            await self._channel.close()

    # ---- data plane -------------------------------------------------------------------------

    async def _request(
        self,
        header: dataplane_pb2.KVStoreHeader,
        payload: Sequence[Frame],
        timeout_s: float | None,
    ) -> _Reply:
        op = dataplane_pb2.KVStoreOp.Name(header.op)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        reply, frames = await self._socket().request(header, payload, timeout_s=timeout, what=op)
        if reply.error:
            raise KVStoreError(f"kvstore {self.endpoint} rejected {op}: {reply.error}")
        return reply, frames

    def _socket(self) -> SeqDealer[dataplane_pb2.KVStoreHeader]:
        if self._closed:
            raise Unavailable(f"kvstore client for {self.endpoint} is closed")
        if self._dealer is None:
            if self._ctx is None:
                self._ctx = zmq_context(self._tls)
            self._dealer = SeqDealer(
                self._ctx, self.endpoint, dataplane_pb2.KVStoreHeader, "kvstore"
            )
        return self._dealer

    # ---- control plane ----------------------------------------------------------------------

    async def _rpc(self, method: str, request: Message, timeout_s: float | None) -> Any:
        if self._closed:
            raise Unavailable(f"kvstore client for {self.address} is closed")
        if self._stub is None:
            self._channel = aio_channel(self.address, self._tls, channel_options())
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await getattr(self._stub, method)(request, timeout=timeout, metadata=metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValidationError(method, e.details() or "invalid argument") from None
            raise Unavailable(
                f"kvstore {self.address}: {method} failed: {e.code().name}: {e.details()}"
            ) from None


def _check(layout: str, hashes: Sequence[bytes]) -> None:
    if not layout:
        raise ValidationError("layout", "must be set")
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise ValidationError(f"block_hashes[{i}]", f"must be {HASH_BYTES} bytes, got {len(h)}")
