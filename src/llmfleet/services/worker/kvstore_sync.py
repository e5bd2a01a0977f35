"""A worker's use of the shared kvstore: fetch a longer prefix before admission, put new blocks.

    sync = KVStoreSync(client, engine, loop, layout_key, ctx=ctx, events_endpoint=...)
    await sync.start()                             # subscribe to the kvstore's KV events
    sync.view_holds_none(hashes)                   # True: admission may skip the lookup
    num_remote = await sync.fetch_prefix(hashes)   # before admission; None: no kvstore view
    sync.expect_put(request_id, hashes[num_remote:])
    ... engine loop, between steps: sync.on_output(out) schedules the put once the prompt is done

Fetched blocks are imported into the local prefix cache (they then count as cached tokens).

The view. With the kvstore's event endpoint the worker keeps the set of hashes the kvstore
holds (stored/evicted events with seq numbers, a `GetKVSnapshot` resync on a gap; the same
index the router keeps of its workers). When the view is in sync and holds none of a
prompt's chain, admission skips the lookup RPC. A view a few events behind only misses a
reuse (the prompt is computed, and its blocks put again); it never admits wrong KV, since
every fetch still goes through `lookup` and `get`.

Puts are background work, never on the engine's critical path: `put_delay_s` after the
prompt's first token (so they do not compete with that token's way to the client), its blocks
are held by hash between two steps and copied to pinned host memory on a side stream beside
the later steps (`KVHandoff.start_export`); once copied they are let go and sent. Blocks
evicted before the put starts skip it. At most `max_put_bytes` of KV are in flight: a put over
that budget is dropped (counted in `num_blocks_dropped`), losing only the reuse. A kvstore that
is down likewise only costs the reuse, never a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

import zmq.asyncio
from opentelemetry import trace
from opentelemetry.trace import Span

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import RequestOutput
from llmfleet.services.worker.kv_transfer import stage_frames
from llmfleet.services.worker.kvstore_client import KVStoreClient
from llmfleet.services.worker.loop import EngineLoop
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.core.kv_index import KVSnapshot
from llmfleet.shared.core.step_model import mix
from llmfleet.shared.wire.kv_subscriber import KVSubscriber
from llmfleet.shared.wire.transport import MalformedFrame, tensor_frame

logger = logging.getLogger(__name__)


_KVSTORE = "kvstore"  # the view's one publisher


class KVStoreSync:
    def __init__(
        self,
        client: KVStoreClient,
        engine: LLMEngine,
        loop: EngineLoop,
        layout_key: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        events_endpoint: str | None = None,
        put_delay_s: float = 0.0,
        max_put_bytes: int = 1 << 30,
    ) -> None:
        self.client = client
        self._engine = engine
        self._loop = loop
        self._layout_key = layout_key
        self._ctx = ctx
        self._events_endpoint = events_endpoint
        self._put_delay_s = put_delay_s
        self._view: KVSubscriber | None = None
        # request id -> (hashes the kvstore lacks, span of the admitting RPC: the put's parent)
        self._puts: dict[str, tuple[list[bytes], Span]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}  # puts waiting out put_delay_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_put_bytes = max_put_bytes
        self._put_bytes = 0  # KV bytes of the puts in flight
        self._put_ids = itertools.count()
        shape, dtype = engine.kv.block_shape, engine.kv.dtype
        self._block_bytes = math.prod(shape) * dtype.itemsize
        self.num_blocks_dropped = 0  # blocks of puts dropped over the byte budget
        self.num_blocks_fetched = 0
        self.num_fetches = 0
        # a fetch (get + import) per token, moving average: LoadReport.fetch_seconds_per_token
        self.fetch_s_per_token = 0.0  # measured once num_fetches > 0
        self.num_blocks_stored = 0
        self.num_lookups_skipped = 0

    async def start(self) -> None:
        """Subscribe to the kvstore's events (when an endpoint is configured)."""
        if self._events_endpoint and self._ctx is not None and self._view is None:
            self._view = KVSubscriber(self._ctx, self._fetch_snapshot)
            self._view.subscribe(_KVSTORE, self._events_endpoint)

    async def _fetch_snapshot(self, publisher: str) -> KVSnapshot:
        return await self.client.snapshot()

    def view_holds_none(self, hashes: list[bytes]) -> bool:
        """Whether the view is in sync and holds none of the chain `hashes`, so admission may
        skip the lookup RPC (counted in `num_lookups_skipped`). False: only `lookup` can tell."""
        view = self._view
        if view is None or view.index.is_stale(_KVSTORE):
            return False
        if view.index.matched_prefix(_KVSTORE, hashes):
            return False
        self.num_lookups_skipped += 1
        return True

    @property
    def num_view_blocks(self) -> int | None:
        """Blocks the kvstore holds as far as the view knows; None without one in sync."""
        return None if self._view is None else self._view.index.num_blocks(_KVSTORE)

    async def fetch_prefix(self, hashes: list[bytes]) -> int | None:
        """Import the kvstore's part of the chain beyond the local prefix cache.

        Returns how many leading blocks the kvstore holds (None: unreachable, or no hashes;
        the request then runs without it). Blocks the store evicts between the lookup and the
        get are not held: the get's answer counts, and may be none."""
        if not hashes:
            return None
        engine = self._engine
        # The local count (an engine op) and the kvstore's lookup (an RPC) run concurrently.
        local = self._loop.submit(engine.kv.num_cached_prefix_blocks, hashes)
        try:
            num_remote = await self.client.lookup(self._layout_key, hashes)
            num_local = await local
            if num_remote <= num_local:
                return num_remote
            started = time.perf_counter()
            frames = await self.client.get(self._layout_key, hashes[:num_remote])
            if frames:
                got = hashes[: len(frames)]
                payload = await stage_frames(engine, frames)
                imported = await self._loop.call(
                    lambda: engine.kv.import_cached_blocks(got, payload)
                )
                self.num_blocks_fetched += imported
                tokens = len(frames) * engine.block_manager.block_size
                per_token = (time.perf_counter() - started) / tokens
                self.fetch_s_per_token = mix(self.fetch_s_per_token, per_token, self.num_fetches)
                self.num_fetches += 1
            return len(frames)
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
        """Between steps: schedule the put of a prompt whose first output this is."""
        pending = self._puts.pop(out.request_id, None)
        if pending is None or not out.new_token_ids:
            return  # no put pending, or aborted before its prompt was computed
        if self._put_delay_s <= 0:
            self._start_put(out.request_id, *pending)
            return
        handle = asyncio.get_running_loop().call_later(
            self._put_delay_s, self._start_put, out.request_id, *pending
        )
        self._timers[out.request_id] = handle

    def _start_put(self, rid: str, hashes: list[bytes], parent: Span) -> None:
        self._timers.pop(rid, None)
        nbytes = len(hashes) * self._block_bytes
        if self._put_bytes + nbytes > self._max_put_bytes:
            # Offload never queues work behind the engine: over budget, the put is dropped and
            # only its reuse is lost (a later request computes the prompt, and puts it then).
            self.num_blocks_dropped += len(hashes)
            return
        self._put_bytes += nbytes
        owner = f"kvstore-put:{rid}:{next(self._put_ids)}"
        engine, client, key = self._engine, self.client, self._layout_key
        # On the engine thread, between steps: hold the blocks by hash and start copying them
        # to the host beside later steps (None: they left the prefix cache meanwhile).
        started = self._loop.submit(engine.kv.start_export, owner, hashes)

        async def put() -> None:
            try:
                read = await started
                if read is None:
                    logger.debug("prompt blocks of %s left the cache before the put", rid)
                    return
                try:
                    payload = await asyncio.to_thread(read.wait)
                finally:
                    self._loop.call_soon(engine.kv.end_export, owner)
                frames = [tensor_frame(payload[i]) for i in range(payload.shape[0])]
                with trace.use_span(parent, end_on_exit=False):
                    await client.put(key, hashes, frames)
                self.num_blocks_stored += len(hashes)
            except LLMFleetError as e:
                logger.warning("kvstore put of %d blocks failed: %s", len(hashes), e)
            finally:
                self._put_bytes -= nbytes

        task = asyncio.create_task(put())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._view is not None:
            await self._view.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()
