"""The media store: preprocessed images' pixels, kept by the tokenizer service and served to
workers over ZMQ by content hash (`ImageRef.content_hash`). Pixels never travel over gRPC.

    store = MediaStore(capacity_bytes=1 << 30)           # tokenizer side: bounded bytes, LRU
    store.put(content_hash, PixelInput(pixel_values, grid))
    server = MediaServer(sock, store)                     # a ROUTER socket, bound by the caller
    task = asyncio.create_task(server.run())

    client = MediaClient()                               # worker side: one DEALER per endpoint
    pixels = await client.fetch(image.media_endpoint, [image.content_hash, ...])
    await client.close()

The protocol (dataplane.proto):

    DEALER -> ROUTER   [identity*, MediaRequest(seq, content_hashes)]
    ROUTER -> DEALER   [identity*, MediaReply(seq, images=[MediaTensor...]), tensor frame x N]
                       (* added and consumed by ZMQ; the DEALER sends no empty delimiter)

A reply holds every requested image, or none and `missing` names the hashes the store does not
hold (evicted by the byte budget, or preprocessed by another tokenizer replica); `fetch` raises
`MediaNotFoundError` naming the first of them. Tensor frames go out without copying: the frame
is a view of the stored tensor, whose memory the frame keeps alive even if the store evicts it
meanwhile. A malformed request gets a reply with `error` set and a log line; the loop goes on.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import zmq
import zmq.asyncio

from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.core.multimodal import PixelInput
from llmfleet.shared.wire.dealer import SeqDealer
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tls import FleetTLS, zmq_context
from llmfleet.shared.wire.tracing import traceparent
from llmfleet.shared.wire.transport import (
    Frame,
    MalformedFrame,
    decode,
    dtype_name,
    encode,
    frame_tensor,
    recv_loop,
    tensor_frame,
    torch_dtype,
)
from llmfleet.v1 import dataplane_pb2

logger = logging.getLogger(__name__)

MAX_HASHES_PER_REQUEST = 64
_HEX = frozenset("0123456789abcdef")


class MediaStoreError(LLMFleetError):
    """The media store rejected a request, or its reply broke the protocol."""


class MediaNotFoundError(MediaStoreError):
    """The store does not hold an image (evicted, or never preprocessed there)."""

    def __init__(self, content_hash: str, endpoint: str) -> None:
        super().__init__(f"media store {endpoint} does not hold image {content_hash}")
        self.content_hash = content_hash
        self.endpoint = endpoint


def _check_hash(h: str, field: str) -> None:
    if len(h) != 64 or not set(h) <= _HEX:
        raise ValidationError(field, f"must be 64 lowercase hex digits, got {h[:80]!r}")


def pixel_bytes(pixel: PixelInput) -> int:
    t = pixel.pixel_values
    return int(t.numel() * t.element_size())


class MediaStore:
    """Content hash -> PixelInput, at most `capacity_bytes` of tensors, least recently used
    evicted first. Thread-safe: the tokenizer preprocesses on threads and serves on its loop.

    An image larger than the whole capacity is not kept (`put` returns False).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValidationError("capacity_bytes", f"must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, PixelInput] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_hits = 0  # images served
        self.num_misses = 0  # images asked for and not held
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._items

    def put(self, content_hash: str, pixel: PixelInput) -> bool:
        """Keep `pixel` (a CPU tensor, made contiguous) under `content_hash`; True if held."""
        t = pixel.pixel_values
        if t.device.type != "cpu":
            raise ValueError("the media store holds CPU tensors")
        dtype_name(t.dtype)  # ValueError for a dtype the wire cannot carry
        if not t.is_contiguous():
            pixel = PixelInput(t.contiguous(), pixel.grid)
        size = pixel_bytes(pixel)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if content_hash in self._items:
                self._items.move_to_end(content_hash)
                return True
            while self._items and self.num_bytes + size > self.capacity_bytes:
                _, old = self._items.popitem(last=False)
                self.num_bytes -= pixel_bytes(old)
                self.num_evictions += 1
            self._items[content_hash] = pixel
            self.num_bytes += size
        return True

    def get_all(self, hashes: Sequence[str]) -> tuple[list[PixelInput], list[str]]:
        """(the images, []) when every hash is held (each becomes most recently used), else
        ([], the hashes not held)."""
        with self._lock:
            missing = [h for h in hashes if h not in self._items]
            if missing:
                self.num_misses += len(missing)
                return [], missing
            out = []
            for h in hashes:
                self._items.move_to_end(h)
                out.append(self._items[h])
            self.num_hits += len(out)
            return out, []


class MediaServer:
    """Serves a `MediaStore` on a bound ROUTER socket (the module docstring's protocol).

    `on_fetch(num_hits, num_misses)` runs after each answered request (metrics)."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        store: MediaStore,
        *,
        on_fetch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sock = sock
        self.store = store
        self.on_fetch = on_fetch
        self.num_rejected = 0

    async def run(self) -> None:
        """Serve until cancelled or the socket closes."""
        await recv_loop(self.sock, self.handle, name="media store")

    async def handle(self, frames: list[Frame]) -> None:
        if not frames:
            return
        identity, body = frames[0], frames[1:]
        seq = 0
        try:
            request, payload = decode(body, dataplane_pb2.MediaRequest)
            seq = request.seq
            if payload:
                raise MalformedFrame(f"a MediaRequest with {len(payload)} payload frames")
            hashes = list(request.content_hashes)
            if not 0 < len(hashes) <= MAX_HASHES_PER_REQUEST:
                raise ValidationError(
                    "content_hashes", f"must name 1 to {MAX_HASHES_PER_REQUEST} images"
                )
            for i, h in enumerate(hashes):
                _check_hash(h, f"content_hashes[{i}]")
        except (MalformedFrame, ValidationError) as e:
            self.num_rejected += 1
            logger.warning("media store: rejected request seq=%d: %s", seq, e)
            reply = dataplane_pb2.MediaReply(seq=seq, error=str(e))
            await self.sock.send_multipart([identity, reply.SerializeToString()], copy=False)
            return
        pixels, missing = self.store.get_all(hashes)
        reply = dataplane_pb2.MediaReply(seq=seq, missing=missing)
        out: list[Frame] = []
        for h, p in zip(hashes, pixels, strict=False):
            t = p.pixel_values
            reply.images.append(
                dataplane_pb2.MediaTensor(
                    content_hash=h, dtype=dtype_name(t.dtype), shape=list(t.shape), grid=p.grid
                )
            )
            out.append(tensor_frame(t))
        await self.sock.send_multipart([identity, *encode(reply, out)], copy=False)
        if self.on_fetch is not None:
            self.on_fetch(len(pixels), len(missing))


class MediaClient:
    """Fetches pixels from media stores (any number of endpoints; one DEALER each, made on
    first use). Concurrent fetches from one event loop are safe: replies match by seq.

    `ctx`: a context to make sockets on (a `tls.CurveContext` speaks CURVE); without one a
    private context is made, CURVE with `tls`."""

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        ctx: zmq.asyncio.Context | None = None,
        tls: FleetTLS | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._own_ctx = ctx is None
        self._tls = tls
        self._dealers: dict[str, SeqDealer[dataplane_pb2.MediaReply]] = {}
        self._closed = False

    async def fetch(
        self, endpoint: str, hashes: Sequence[str], *, timeout_s: float | None = None
    ) -> dict[str, PixelInput]:
        """The images `hashes` from the store at `endpoint`, by hash.

        MediaNotFoundError when the store does not hold one of them; Unavailable when it does
        not answer within the timeout; MediaStoreError when it rejects the request."""
        wanted = list(dict.fromkeys(hashes))
        out: dict[str, PixelInput] = {}
        for start in range(0, len(wanted), MAX_HASHES_PER_REQUEST):
            part = wanted[start : start + MAX_HASHES_PER_REQUEST]
            out.update(await self._fetch(endpoint, part, timeout_s))
        return out

    async def _fetch(
        self, endpoint: str, hashes: list[str], timeout_s: float | None
    ) -> dict[str, PixelInput]:
        if self._closed:
            raise Unavailable("media client is closed")
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            if self._ctx is None:
                self._ctx = zmq_context(self._tls)
            dealer = SeqDealer(self._ctx, endpoint, dataplane_pb2.MediaReply, "media store")
            self._dealers[endpoint] = dealer
        request = dataplane_pb2.MediaRequest(content_hashes=hashes, traceparent=traceparent())
        timeout = self.timeout_s if timeout_s is None else timeout_s
        reply, frames = await dealer.request(
            request, (), timeout_s=timeout, what=f"a fetch of {len(hashes)} images"
        )
        return _pixels(reply, frames, hashes, endpoint)

    async def close(self) -> None:
        """Fail fetches in flight with Unavailable and release the sockets."""
        if self._closed:
            return
        self._closed = True
        for dealer in self._dealers.values():
            await dealer.close()
        self._dealers.clear()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()

    async def __aenter__(self) -> MediaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _pixels(
    reply: dataplane_pb2.MediaReply, frames: list[zmq.Frame], hashes: list[str], endpoint: str
) -> dict[str, PixelInput]:
    if reply.error:
        raise MediaStoreError(f"media store {endpoint} rejected a fetch: {reply.error}")
    if reply.missing:
        raise MediaNotFoundError(reply.missing[0], endpoint)
    if len(reply.images) != len(frames) or [m.content_hash for m in reply.images] != hashes:
        raise MediaStoreError(
            f"media store {endpoint}: reply of {len(reply.images)} images and {len(frames)} "
            f"frames for {len(hashes)} hashes"
        )
    out = {}
    for meta, frame in zip(reply.images, frames, strict=True):
        try:
            dtype: torch.dtype = torch_dtype(meta.dtype)
            t = frame_tensor(frame, dtype, list(meta.shape))
        except MalformedFrame as e:
            raise MediaStoreError(f"media store {endpoint}: image {meta.content_hash}: {e}") from e
        out[meta.content_hash] = PixelInput(t, tuple(int(g) for g in meta.grid))
    return out
