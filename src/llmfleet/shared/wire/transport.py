"""ZMQ data-plane framing: a protobuf header frame followed by raw tensor frames.

    frames = encode(header, [tensor_frame(t) for t in blocks])   # send_multipart(copy=False)
    header, payload = decode(frames, KVTransferHeader)            # raises MalformedFrame

Large payload frames are sent without copying (`tensor_frame` exposes the tensor's memory; the
caller keeps the tensor alive until the send completes — pyzmq's copy=False with a tracker, or
simply awaiting the send). Receivers turn frames back into tensors with `frame_tensor`, which
wraps the received buffer without copying. Nothing here unpickles anything.

`recv_loop` runs a handler on every message of a socket and survives malformed ones.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError, Message

from llmfleet.shared.wire.tls import CurveContext

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
Frame = bytes | memoryview | zmq.Frame

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MalformedFrame(ValueError):
    """A multipart message that does not parse as the expected header and payload."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise MalformedFrame(f"unknown dtype {name!r}") from None


def kv_layout_key(
    model_id: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
) -> str:
    """The key under which KV blocks of one model and layout are stored and looked up."""
    return f"{model_id}|L{num_layers}|B{block_size}|H{num_kv_heads}|D{head_dim}|{dtype}"


def tensor_frame(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (bf16 travels as raw 16-bit words)."""
    if t.device.type != "cpu":
        raise ValueError("tensor_frame needs a CPU tensor; copy device tensors first")
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def frame_tensor(frame: Frame, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Wrap a received frame as a tensor (no copy; read-only memory is copied once)."""
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if len(buf) != expected:
        raise MalformedFrame(f"payload of {len(buf)} bytes, expected {expected} for {shape}")
    arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).view(dtype).view(*shape)


def encode(header: Message, payload: Sequence[Frame] = ()) -> list[Frame]:
    return [header.SerializeToString(), *payload]


def decode(frames: Sequence[Frame], header_cls: type[M]) -> tuple[M, list[Frame]]:
    if not frames:
        raise MalformedFrame("empty message")
    first = frames[0]
    raw = first.bytes if isinstance(first, zmq.Frame) else bytes(first)
    header = header_cls()
    try:
        header.ParseFromString(raw)
    except DecodeError as e:
        raise MalformedFrame(f"bad {header_cls.__name__} header: {e}") from None
    return header, list(frames[1:])


async def recv_loop(
    sock: zmq.asyncio.Socket,
    handler: Callable[[list[Frame]], Awaitable[None]],
    *,
    name: str,
) -> None:
    """Receive forever, handing each multipart message to `handler`.

    A handler raising MalformedFrame (or any error) is logged and the loop goes on; only
    cancellation or a closed socket ends it.
    """
    while True:
        try:
            frames = await sock.recv_multipart(copy=False)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if e.errno == zmq.ENOTSOCK or sock.closed:
                return
            logger.warning("%s: receive failed: %s", name, e)
            continue
        try:
            await handler(frames)
        except asyncio.CancelledError:
            raise
        except MalformedFrame as e:
            logger.warning("%s: dropped malformed message: %s", name, e)
        except Exception:
            logger.exception("%s: handler failed; message dropped", name)


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")


def reachable_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host peers use to reach a socket bound on `bind_host`: `advertise_host` when given
    (a pod's IP under Kubernetes), else the bind host itself, unless it is a wildcard, which no
    peer can connect to: then this machine's name's address (a pod's hostname resolves to its
    IP)."""
    if advertise_host:
        return advertise_host
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    return socket.gethostbyname(socket.gethostname())


def bind(
    ctx: zmq.asyncio.Context,
    kind: int,
    host: str,
    port: int = 0,
    advertise_host: str | None = None,
) -> tuple[zmq.asyncio.Socket, str]:
    """Bind a socket on host:port (0: a free port); returns it and the tcp:// endpoint peers
    connect to (`reachable_host`).

    On a `CurveContext` the socket is a CURVE server admitting only the fleet's keys."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if isinstance(ctx, CurveContext):
        ctx.serve(sock)
    reach = reachable_host(host, advertise_host)
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return sock, f"tcp://{reach}:{port}"
    chosen = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{reach}:{chosen}"
