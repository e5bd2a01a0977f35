"""The tokenizer service's images: the media store it keeps preprocessed pixels in, served to
workers over ZMQ (shared/wire/media.py), and the preprocessing metrics.

    host = MediaHost(config, tls)
    await host.start()                  # binds the ROUTER on config.host:config.media_port
    refs = host.keep(prompt)            # pixels into the store; ImageRefs naming its endpoint
    await host.close()
"""

from __future__ import annotations

import asyncio
import logging

import prometheus_client
import zmq

from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef
from llmfleet.shared.wire.media import MediaServer, MediaStore, pixel_bytes
from llmfleet.shared.wire.service import cancel_and_wait
from llmfleet.shared.wire.tls import FleetTLS, zmq_context
from llmfleet.shared.wire.transport import bind
from llmfleet.text.media import MediaPolicy
from llmfleet.text.multimodal import MultimodalPrompt

logger = logging.getLogger(__name__)

PREPROCESS_SECONDS = prometheus_client.Histogram(
    "llmfleet:tokenizer_preprocess_seconds",
    "Image preprocessing of one Tokenize call with images (read, decode, image processor, hash)",
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
IMAGES = prometheus_client.Counter(
    "llmfleet:tokenizer_images_total", "Images preprocessed by Tokenize calls"
)
STORE_BYTES = prometheus_client.Gauge(
    "llmfleet:media_store_bytes", "Bytes of preprocessed pixels the media store holds"
)
STORE_IMAGES = prometheus_client.Gauge(
    "llmfleet:media_store_images", "Images the media store holds"
)
STORE_FETCHES = prometheus_client.Counter(
    "llmfleet:media_store_fetches_total",
    "Images workers asked the media store for: served (hit) or not held (miss)",
    ["result"],
)
for _result in ("hit", "miss"):
    STORE_FETCHES.labels(_result)


def media_policy(config: TokenizerConfig) -> MediaPolicy:
    return MediaPolicy(
        allowed_media_dir=config.allowed_media_dir,
        allow_remote_media=config.allow_remote_media,
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        limit_images_per_prompt=config.limit_images_per_prompt,
    )


class MediaHost:
    """The media store of one tokenizer service and its ZMQ server."""

    def __init__(self, config: TokenizerConfig, tls: FleetTLS | None) -> None:
        self.config = config
        self.tls = tls
        self.policy = media_policy(config)
        self.store = MediaStore(config.media_store_mb * 1024 * 1024)
        self.endpoint = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._ctx = zmq_context(self.tls)
        self._sock, self.endpoint = bind(
            self._ctx, zmq.ROUTER, self.config.host, self.config.media_port
        )
        server = MediaServer(self._sock, self.store, on_fetch=self._on_fetch)
        self._task = asyncio.create_task(server.run())
        logger.info("media store serving on %s (%d MiB)", self.endpoint, self.config.media_store_mb)

    def keep(self, prompt: MultimodalPrompt) -> list[ImageRef]:
        """Store the prompt's pixels (thread-safe); its ImageRefs. ValidationError for an image
        whose pixels alone exceed the store."""
        for image in prompt.images:
            if not self.store.put(image.content_hash, image.pixel):
                raise ValidationError(
                    image.field,
                    f"the preprocessed image is {pixel_bytes(image.pixel)} bytes, more than the "
                    f"media store's {self.config.media_store_mb} MiB",
                )
        IMAGES.inc(len(prompt.images))
        self._update_gauges()
        return [image.ref(self.endpoint) for image in prompt.images]

    def _on_fetch(self, hits: int, misses: int) -> None:
        if hits:
            STORE_FETCHES.labels("hit").inc(hits)
        if misses:
            STORE_FETCHES.labels("miss").inc(misses)
        self._update_gauges()

    def _update_gauges(self) -> None:
        STORE_BYTES.set(self.store.num_bytes)
        STORE_IMAGES.set(len(self.store))

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
