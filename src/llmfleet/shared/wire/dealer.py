"""A DEALER socket to one ROUTER endpoint whose replies match their requests by `seq`.

Both ends speak `transport.encode`/`decode` frames: a protobuf header with a `seq` field, then
raw payload frames. `request` numbers the header, sends it and waits for the reply of the same
seq, which one task reading the socket hands over; replies that come late (their request timed
out) or name no pending request are dropped. Concurrent requests from one event loop are safe.
The kvstore client and the media client use it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Generic, TypeVar

import zmq
import zmq.asyncio
from google.protobuf.message import Message

from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.transport import Frame, MalformedFrame, decode, encode

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


class SeqDealer(Generic[R]):
    """`name` ("kvstore", "media store") words the errors: Unavailable on a timeout, a send
    that fails, or `close` while a request waits."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, reply_cls: type[R], name: str
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self._reply_cls = reply_cls
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[R, list[Frame]]]] = {}
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._task = asyncio.create_task(self._receive())

    async def request(
        self, header: Message, payload: Sequence[Frame], *, timeout_s: float, what: str
    ) -> tuple[R, list[Frame]]:
        """Send `header` (its `seq` set here) and `payload`; the reply's header and frames.
        `what` names the request in a timeout's message."""
        seq = next(self._seq)
        header.seq = seq  # type: ignore[attr-defined]
        fut: asyncio.Future[tuple[R, list[Frame]]] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            async with asyncio.timeout(timeout_s):
                await self.sock.send_multipart(encode(header, payload), copy=False)
                return await fut
        except TimeoutError:
            raise Unavailable(
                f"{self.name} {self.endpoint}: no reply to {what} seq={seq} within {timeout_s:g} s"
            ) from None
        except zmq.ZMQError as e:
            raise Unavailable(f"{self.name} {self.endpoint}: {what} failed: {e}") from None
        finally:
            self._pending.pop(seq, None)

    async def _receive(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
                reply, payload = decode(frames, self._reply_cls)
            except asyncio.CancelledError:
                raise
            except MalformedFrame as e:
                logger.warning("%s client: dropped malformed reply: %s", self.name, e)
                continue
            except zmq.ZMQError as e:
                if self.sock.closed:
                    return
                logger.warning("%s client: receive from %s failed: %s", self.name, self.endpoint, e)
                continue
            fut = self._pending.get(reply.seq)  # type: ignore[attr-defined]
            if fut is None or fut.done():
                logger.debug("%s client: late or unknown reply dropped", self.name)
                continue
            fut.set_result((reply, payload))

    async def close(self) -> None:
        """Fail the requests in flight with Unavailable and close the socket."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(f"{self.name} client for {self.endpoint} closed"))
        self._pending.clear()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
