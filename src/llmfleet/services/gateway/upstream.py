"""The gateway's view of the fleet: the router's gRPC client, the served model, its tokenizer.

The served model is what the router's `GetModelInfo` reports (the workers' model), named
`served_model_name` when configured. It is fetched on first use and kept; a failure to reach
the router is a 503 to the HTTP client, not a crash, so the gateway can start before the
fleet and ride out a router restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from llmfleet.client.generation import AsyncGenerationClient, ClientError
from llmfleet.services.gateway.errors import APIError, model_not_found
from llmfleet.services.gateway.tokens import TokenSpeller
from llmfleet.shared.core.config import GatewayConfig
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.text.image_processing import ImageProcessor

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients send as `model`
    info: ModelInfo
    created: int  # unix time the gateway first saw it served


class Upstream:
    """Create and use inside one running event loop (the gRPC channel is bound to it)."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Any,
        *,
        api_key: str | None = None,
        images: ImageProcessor | None = None,
    ) -> None:
        """`api_key`: sent with the gateway's own calls; Generate calls carry their caller's.
        `images`: the served model's image processor (None: it takes no images)."""
        self.config = config
        self.client = AsyncGenerationClient(config.router_address, api_key=api_key)
        self.speller = TokenSpeller(tokenizer, images)
        self._model: ServedModel | None = None
        self._lock = asyncio.Lock()

    async def model(self, *, refresh: bool = False) -> ServedModel:
        """The served model; raises APIError 503 when the router cannot tell it."""
        if self._model is not None and not refresh:
            return self._model
        async with self._lock:
            try:
                info = await self.client.model_info(timeout=_PROBE_TIMEOUT_S)
            except ClientError as exc:
                raise APIError(
                    503,
                    f"the router at {self.config.router_address} cannot serve: {exc}",
                    type="service_unavailable_error",
                    code="service_unavailable",
                ) from None
            name = self.config.served_model_name or info.model_id
            if self._model is None or self._model.info != info:
                logger.info("serving model %s (%s)", name, info.model_id)
                self._model = ServedModel(name, info, int(time.time()))
            return self._model

    async def require(self, requested: str) -> ServedModel:
        """The served model if `requested` names it; 404 otherwise."""
        served = await self.model()
        if requested != served.name:
            raise model_not_found(requested)
        return served

    async def close(self) -> None:
        await self.client.close()
