"""The kvstore's ZMQ data plane: a ROUTER socket serving `KVStoreHeader` put/get from DEALERs.

    DEALER -> ROUTER   [identity*, header(op=PUT, seq, layout, block_hashes), block frame x N]
    ROUTER -> DEALER   [identity*, header(op=REPLY, seq, found_count=stored)]
    DEALER -> ROUTER   [identity*, header(op=GET, seq, layout, block_hashes)]
    ROUTER -> DEALER   [identity*, header(op=REPLY, seq, found_count=k), block frame x k]
                       (* added and consumed by ZMQ; the DEALER sends no empty delimiter)

A GET returns the first k blocks of the listed chain that the store holds, k possibly 0. Block
frames go out without copying (the store keeps the received frames' buffers). A request that
does not parse or breaks a rule (op unset or REPLY, frame count != hash count, hashes not 32
bytes, put frames of unequal size or of a size other than the layout's, empty layout) gets a
REPLY with `error` set and the request's seq (0 when the header itself is unreadable), and a log
line; the loop goes on.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import zmq
import zmq.asyncio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from llmfleet.services.kvstore.runner import StoreRunner
from llmfleet.services.kvstore.store import HASH_BYTES
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.tracing import context_from_traceparent
from llmfleet.shared.wire.transport import Frame, MalformedFrame, decode
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The tail of `shared.transport.kv_layout_key`: model id (may itself hold "|"), then the shape.
_LAYOUT_RE = re.compile(r"^(?P<model>.*)\|L(\d+)\|B(\d+)\|H(\d+)\|D(\d+)\|(?P<dtype>\w+)$")


def layout_block_bytes(layout: str) -> int:
    """Bytes of one block payload of a `kv_layout_key` layout (ValidationError if malformed)."""
    m = _LAYOUT_RE.match(layout)
    if m is None or m.group("dtype") not in _ELEMENT_BYTES:
        raise ValidationError("layout", f"{layout!r} is not a kv_layout_key")
    num_layers, block_size, num_kv_heads, head_dim = (int(m.group(i)) for i in range(2, 6))
    elements = num_layers * 2 * block_size * num_kv_heads * head_dim
    return elements * _ELEMENT_BYTES[m.group("dtype")]


class DataPlane:
    """Handles one ROUTER message at a time (see the module docstring for the protocol)."""

    def __init__(self, sock: zmq.asyncio.Socket, runner: StoreRunner) -> None:
        self.sock = sock
        self.runner = runner
        self.num_rejected = 0

    async def handle(self, frames: list[Frame]) -> None:
        if not frames:
            return
        identity, body = frames[0], frames[1:]
        seq = 0
        try:
            header, payload = decode(body, dataplane_pb2.KVStoreHeader)
            seq = header.seq
            parent = context_from_traceparent(header.traceparent)
            if parent is None:
                reply, out = await self._serve(header, payload)
            else:
                reply, out = await self._serve_traced(header, payload, parent)
        except (MalformedFrame, ValidationError) as e:
            await self._reject(identity, seq, str(e))
            return
        except Exception as e:
            logger.exception("kvstore data plane: request seq=%d failed", seq)
            await self._reject(identity, seq, f"internal error: {type(e).__name__}")
            return
        await self.sock.send_multipart([identity, reply.SerializeToString(), *out], copy=False)

    async def _serve_traced(
        self, header: dataplane_pb2.KVStoreHeader, payload: list[Frame], parent: Context
    ) -> tuple[dataplane_pb2.KVStoreHeader, Sequence[Frame]]:
        """`_serve` as a `kvstore.serve_get` / `kvstore.serve_put` span under the caller's."""
        name = (
            "kvstore.serve_get"
            if header.op == dataplane_pb2.KV_STORE_OP_GET
            else "kvstore.serve_put"
        )
        attrs = {"llmfleet.kv.num_blocks": len(header.block_hashes)}
        with tracer.start_as_current_span(name, parent, SpanKind.SERVER, attrs) as span:
            reply, out = await self._serve(header, payload)
            span.set_attribute("llmfleet.kvstore.found_count", reply.found_count)
            return reply, out

    async def _serve(
        self, header: dataplane_pb2.KVStoreHeader, payload: list[Frame]
    ) -> tuple[dataplane_pb2.KVStoreHeader, Sequence[Frame]]:
        hashes = list(header.block_hashes)
        if header.op not in (dataplane_pb2.KV_STORE_OP_PUT, dataplane_pb2.KV_STORE_OP_GET):
            name = dataplane_pb2.KVStoreOp.Name(header.op) if header.op in (0, 3) else header.op
            raise ValidationError("op", f"must be KV_STORE_OP_PUT or KV_STORE_OP_GET, got {name}")
        if not header.layout:
            raise ValidationError("layout", "must be set")
        for i, h in enumerate(hashes):
            if len(h) != HASH_BYTES:
                raise ValidationError(
                    f"block_hashes[{i}]", f"must be {HASH_BYTES} bytes, got {len(h)}"
                )
        reply = dataplane_pb2.KVStoreHeader(op=dataplane_pb2.KV_STORE_OP_REPLY, seq=header.seq)
        if header.op == dataplane_pb2.KV_STORE_OP_GET:
            if payload:
                raise MalformedFrame(f"GET with {len(payload)} payload frames")
            blocks = await self.runner.get(header.layout, hashes)
            reply.found_count = len(blocks)
            return reply, blocks
        if len(payload) != len(hashes):
            raise MalformedFrame(f"PUT of {len(hashes)} hashes with {len(payload)} frames")
        views = [f.buffer if isinstance(f, zmq.Frame) else memoryview(f) for f in payload]
        if views:
            expected = layout_block_bytes(header.layout)
            for i, v in enumerate(views):
                if v.nbytes != expected:
                    raise MalformedFrame(
                        f"PUT frame {i} has {v.nbytes} bytes, layout {header.layout!r} "
                        f"needs {expected}"
                    )
        reply.found_count = await self.runner.put(header.layout, hashes, views)
        return reply, ()

    async def _reject(self, identity: Frame, seq: int, error: str) -> None:
        self.num_rejected += 1
        logger.warning("kvstore data plane: rejected request seq=%d: %s", seq, error)
        reply = dataplane_pb2.KVStoreHeader(
            op=dataplane_pb2.KV_STORE_OP_REPLY, seq=seq, error=error
        )
        await self.sock.send_multipart([identity, reply.SerializeToString()], copy=False)
