"""Admission into a running worker's engine: validate, fetch a kvstore prefix, admit, route.

    admission = Admission(engine_loop, routes, request_spans, block_size=...)
    admission.kvstore = sync        # once a kvstore is connected (start-up), else None
    num_cached = await admission.admit(rid, prompt, params, cache_salt,
                                       reply_endpoint=endpoint, prefill_only=False)  # AddRequest
    num_cached = await admission.admit_prefill(rid, prompt, params, cache_salt)      # Prefill

The admission proper is one engine op, between steps: the prefix-cache count, `add_request`
(which validates), the reply route, the kvstore put to expect and the request's spans, so no
step schedules a request before it is routed and followed. Without a kvstore, or when the
kvstore's view holds none of the prompt's chain, that op is the whole admission (one hop on the
TTFT path). Otherwise the request is validated (an engine op) while the kvstore fetch runs,
both being on the TTFT path, and an invalid request cancels the fetch. A structured-output
constraint is compiled first, on a pool thread (milliseconds to seconds: never on the engine
thread), so `add_request` finds it in the engine's grammar cache. A prompt's images that the
engine's encoder cache lacks have their pixels fetched first, from each image's media store
(`MediaClient`, ZMQ); when the cache dropped one meanwhile (`MissingPixels`), it is fetched and
the admission tried once more.

Owned by the worker's event loop; `routes` is the worker's request id -> reply endpoint table,
which this adds to and never removes from.
"""

from __future__ import annotations

import asyncio
import functools

from opentelemetry import trace

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.mm_inputs import MissingPixels
from llmfleet.services.worker.decode_side import EngineAccess
from llmfleet.services.worker.kvstore_sync import KVStoreSync
from llmfleet.services.worker.outputs import PROMPT_TOKENS
from llmfleet.services.worker.request_spans import RequestSpans
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef, PixelInput, mm_spans
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.wire.media import MediaClient, MediaStoreError
from llmfleet.shared.wire.service import FailedPrecondition


class Admission:
    def __init__(
        self,
        engine_loop: EngineAccess,
        routes: dict[str, str],
        request_spans: RequestSpans,
        *,
        block_size: int,
        media: MediaClient | None = None,
    ) -> None:
        self._engine_loop = engine_loop
        self._routes = routes
        self._request_spans = request_spans
        self._block_size = block_size
        self.kvstore: KVStoreSync | None = None
        self.media = media or MediaClient()  # pixels of images from the tokenizers' stores

    async def close(self) -> None:
        await self.media.close()

    async def admit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str,
        *,
        reply_endpoint: str | None,
        prefill_only: bool,
        replayed: int = 0,
        images: tuple[ImageRef, ...] = (),
    ) -> int:
        """Validate, fetch a kvstore prefix, admit; returns the prompt tokens found cached
        (whole blocks, one block fewer when they cover the whole prompt). `replayed`: the
        prompt's last tokens are output generated elsewhere (AddRequest.num_replayed_tokens);
        `images`: the prompt's (pixels fetched for those the encoder cache lacks)."""
        engine, loop = self._engine_loop()
        await precompile(engine, params)
        model_id = engine.spec.model_id
        ctx = HashContext(model_id, cache_salt)
        hashes = hash_block_chain(prompt, self._block_size, ctx, mm_spans(images))
        engine.intake.check_images(prompt, images, None)  # the model takes them, runs fit
        cache = engine.mm.cache
        pixels = await self._fetch(
            images, [im.content_hash for im in images if im.content_hash not in cache]
        )
        kvstore = self.kvstore
        rpc_span = trace.get_current_span()  # the admitting RPC's (spans outlive the call)

        def admit(num_remote: int | None) -> int:
            num_cached = engine.kv.num_cached_prefix_blocks(hashes)
            engine.add_request(
                request_id,
                prompt,
                params,
                cache_salt=cache_salt,
                prefill_only=prefill_only,
                num_replayed_tokens=replayed,
                images=images,
                pixels=pixels,
            )
            if reply_endpoint:
                self._routes[request_id] = reply_endpoint
            if kvstore is not None and num_remote is not None and num_remote < len(hashes):
                kvstore.expect_put(request_id, hashes[num_remote:], rpc_span)
            self._request_spans.expect(rpc_span)
            loop.post(  # before any step's outputs reach the event loop
                functools.partial(
                    self._request_spans.admitted,
                    request_id,
                    rpc_span,
                    len(prompt),
                    params.n,
                    prefill_only=prefill_only,
                )
            )
            return num_cached

        async def admit_fetching(num_remote: int | None) -> int:
            try:
                return await loop.call(admit, num_remote)
            except MissingPixels as e:  # the encoder cache dropped them since the check
                pixels.update(await self._fetch(images, e.hashes))
                return await loop.call(admit, num_remote)

        if kvstore is None or kvstore.view_holds_none(hashes):
            num_cached_blocks = await admit_fetching(None if kvstore is None else 0)
        else:
            valid = loop.submit(engine.validate_request, request_id, prompt, params, replayed)
            fetch = asyncio.create_task(kvstore.fetch_prefix(hashes))
            try:
                await valid
            except BaseException:
                fetch.cancel()
                raise
            num_cached_blocks = await admit_fetching(await fetch)
        PROMPT_TOKENS.labels(model_id).inc(len(prompt))
        tokens = num_cached_blocks * self._block_size
        return max(0, tokens - self._block_size) if tokens >= len(prompt) else tokens

    async def admit_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str,
        images: tuple[ImageRef, ...] = (),
    ) -> int:
        """A prefill-only request (the prefill side's `Admit`): no reply route."""
        return await self.admit(
            request_id,
            prompt,
            params,
            cache_salt,
            reply_endpoint=None,
            prefill_only=True,
            images=images,
        )

    async def _fetch(
        self, images: tuple[ImageRef, ...], hashes: list[str]
    ) -> dict[str, PixelInput]:
        """The pixels of `hashes` (some of `images`), from each image's media store.
        FailedPrecondition when a store no longer holds one (the prompt must be sent again);
        ValidationError when an image names no store."""
        by_endpoint: dict[str, list[str]] = {}
        wanted = set(hashes)
        for i, im in enumerate(images):
            if im.content_hash in wanted:
                if not im.media_endpoint:
                    raise ValidationError(
                        f"images[{i}].media_endpoint",
                        "must name the media store of an image this worker does not hold",
                    )
                by_endpoint.setdefault(im.media_endpoint, []).append(im.content_hash)
        pixels: dict[str, PixelInput] = {}
        try:
            for endpoint, part in by_endpoint.items():
                pixels.update(await self.media.fetch(endpoint, part))
        except MediaStoreError as e:
            raise FailedPrecondition(str(e)) from e
        return pixels


async def precompile(engine: LLMEngine, params: SamplingParams) -> None:
    """Compile `params`' structured-output constraint into the engine's grammar cache on a pool
    thread; raises its ValidationError. Nothing to do without a constraint."""
    grammars = engine.intake.grammars
    if params.structured_output is not None and grammars is not None:
        await asyncio.to_thread(grammars.compile, params.structured_output)
