"""A worker's use of the shared kvstore: fetch a longer prefix before admission, put new blocks.

    sync = KVStoreSync(client, engine, loop, layout_key)
    num_remote = await sync.fetch_prefix(hashes)   # before admission; None: no kvstore view
    sync.expect_put(request_id, hashes[num_remote:])
    ... engine loop, between steps: sync.on_output(out) starts the put once the prompt is done

Fetched blocks are imported into the local prefix cache (they then count as cached tokens).
Puts read the prompt's blocks between steps, before anything can evict them, and send them
in the background; a kvstore that is down only costs the reuse, never a request.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from opentelemetry import trace
from opentelemetry.trace import Span

from llmfleet.services.worker.engine.engine import LLMEngine, RequestOutput
from llmfleet.services.worker.loop import EngineLoop
from llmfleet.shared.errors import LLMFleetError
from llmfleet.shared.kvstore_client import KVStoreClient
from llmfleet.shared.transport import MalformedFrame, frame_tensor, tensor_frame

logger = logging.getLogger(__name__)


class KVStoreSync:
    def __init__(
        self, client: KVStoreClient, engine: LLMEngine, loop: EngineLoop, layout_key: str
    ) -> None:
        self.client = client
        self._engine = engine
        self._loop = loop
        self._layout_key = layout_key
        # request id -> (hashes the kvstore lacks, span of the admitting RPC: the put's parent)
        self._puts: dict[str, tuple[list[bytes], Span]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_blocks_fetched = 0
        self.num_blocks_stored = 0

    async def fetch_prefix(self, hashes: list[bytes]) -> int | None:
        """Import the kvstore's part of the chain beyond the local prefix cache.

        Returns how many leading blocks the kvstore holds (None: unreachable, or no hashes;
        the request then runs without it)."""
        if not hashes:
            return None
        engine = self._engine
        # The local count (an engine op) and the kvstore's lookup (an RPC) run concurrently.
        local = self._loop.submit(engine.num_cached_prefix_blocks, hashes)
        try:
            num_remote = await self.client.lookup(self._layout_key, hashes)
            num_local = await local
            if num_remote > num_local:
                frames = await self.client.get(self._layout_key, hashes[:num_remote])
                shape, dtype = engine.kv_block_shape, engine.kv_dtype
                views = [frame_tensor(f, dtype, shape) for f in frames]
                got = hashes[: len(frames)]
                imported = await self._loop.call(
                    lambda: engine.import_cached_blocks(got, torch.stack(views))
                )
                self.num_blocks_fetched += imported
            return num_remote
        except (LLMFleetError, MalformedFrame) as e:
            logger.warning("kvstore unavailable for a prefix fetch: %s", e)
            return None

    def expect_put(
        self, request_id: str, hashes: list[bytes], parent: Span = trace.INVALID_SPAN
    ) -> None:
        """Put `hashes` (the tail of the prompt's chain) once `request_id`'s prompt is computed;
        `parent`: the span the put belongs under (the request's admission)."""
        self._puts[request_id] = (hashes, parent)

    def on_output(self, out: RequestOutput) -> None:
        """Between steps: start the put of a prompt whose first output this is."""
        pending = self._puts.pop(out.request_id, None)
        if pending is None or not out.new_token_ids:
            return  # no put pending, or aborted before its prompt was computed
        hashes, parent = pending
        rid = out.request_id
        client, key = self.client, self._layout_key
        # Queued now, so it runs before the next step: the blocks are still cached unless an
        # op ahead of it freed them. (A read is torch work: on the engine thread.)
        read = self._loop.submit(self._engine.read_cached_blocks, hashes)

        async def put() -> None:
            try:
                payload = await read
                if payload is None:
                    logger.debug("prompt blocks of %s left the cache before the put", rid)
                    return
                frames = [tensor_frame(payload[i]) for i in range(payload.shape[0])]
                with trace.use_span(parent, end_on_exit=False):
                    await client.put(key, hashes, frames)
                self.num_blocks_stored += len(hashes)
            except LLMFleetError as e:
                logger.warning("kvstore put of %d blocks failed: %s", len(hashes), e)

        task = asyncio.create_task(put())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()
