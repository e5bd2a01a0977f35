"""The tokenizer service: `llmfleet.v1.Tokenizer` over the core in chat.py and detokenizer.py.

    svc = await start(TokenizerConfig(port=0))     # SERVING once the tokenizer is loaded
    ...
    svc.request_stop(); await svc.wait_for_termination()

The servicer is a thin shell: protobuf in, core functions, protobuf out. Validation errors from
the core name fields as the core spells them (`prompt`, `messages[0].role`); they are renamed to
their path in the request message here (`text`, `chat.messages[0].role`). A request's
`max_num_tokens` (the context length) refuses a longer prompt, before tokenizing a text that the
cheap bound of text/prompt_bound.py already shows too long.

A chat for a vision-language model may carry images (ChatMessage.parts): they are read,
decoded, preprocessed and hashed on a worker thread (text/multimodal.py), their pixels kept in
the service's media store (images.py), and the response lists them as ImageRefs. A core error
about a part (`messages[1].content[0]`) names it in the request (`chat.messages[1].parts[0]`).

Detokenize carries many sequences on one stream (a router keeps one): detokenize.py holds a
stream's sequences and answers each request that feeds tokens with one response.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
import prometheus_client
from opentelemetry import trace

from llmfleet.models.checkpoint_files import BUNDLED_MODEL_ID
from llmfleet.services.tokenizer.detokenize import DetokenizeSession
from llmfleet.services.tokenizer.images import PREPROCESS_SECONDS, MediaHost
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef
from llmfleet.shared.wire import tls
from llmfleet.shared.wire.chat import chat_messages_from_pb, tools_from_pb
from llmfleet.shared.wire.convert import images_to_pb
from llmfleet.shared.wire.service import Service, Unavailable, abort_with
from llmfleet.shared.wire.tracing import child_span
from llmfleet.text.chat import encode_rendered, render_chat, tokenize_prompt
from llmfleet.text.image_processing import ImageProcessor, load_image_processor
from llmfleet.text.loading import load_tokenizer
from llmfleet.text.media import MediaPolicy
from llmfleet.text.multimodal import check_no_placeholder_ids, encode_chat_with_images
from llmfleet.text.prompt_bound import max_bytes_per_token, min_num_tokens
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name

LATENCY = prometheus_client.Histogram(
    "llmfleet:tokenizer_latency_seconds",
    "Time to serve one Tokenize call or one Detokenize request (many sequences)",
    ["op"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0),
)

T = TypeVar("T")
Encoded = tuple[list[int], list[ImageRef]]
_PART = re.compile(r"^messages\[(\d+)\]\.content\[")


def _renamed(exc: ValidationError, field: str) -> ValidationError:
    return ValidationError(field, exc.message)


def _in_chat(exc: ValidationError) -> ValidationError:
    """A core error about a chat, named by its path in TokenizeRequest (`chat.` prefixed; a
    content part `messages[i].content[j]` is `chat.messages[i].parts[j]`)."""
    if exc.field.startswith("chat."):
        return exc
    return _renamed(exc, "chat." + _PART.sub(r"messages[\1].parts[", exc.field))


def _check_bound(text: str, per_token: int | None, limit: int, field: str) -> None:
    """Refuse a text that has more than `limit` tokens by the cheap bound (prompt_bound.py)."""
    if not limit or per_token is None:
        return
    at_least = min_num_tokens(text, per_token)
    if at_least > limit:
        raise ValidationError(
            field,
            f"the prompt has at least {at_least} tokens, more than the context length of "
            f"{limit} tokens",
        )


def _check_len(num_tokens: int, limit: int, field: str) -> None:
    if limit and num_tokens > limit:
        raise ValidationError(
            field,
            f"the prompt has {num_tokens} tokens, more than the context length of {limit} tokens",
        )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Answers UNAVAILABLE until `set_tokenizer` is called (the service is NOT_SERVING then)."""

    def __init__(
        self,
        tokenizer: Any | None = None,
        *,
        media: MediaHost | None = None,
        model_name: str = BUNDLED_MODEL_ID,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer) if tokenizer is not None else 0
        self._per_token = max_bytes_per_token(tokenizer) if tokenizer is not None else None
        self._processor: ImageProcessor | None = None
        self._media = media
        self._model_name = model_name

    def set_tokenizer(self, tokenizer: Any, processor: ImageProcessor | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)
        self._per_token = max_bytes_per_token(tokenizer)
        self._processor = processor

    def _require_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise Unavailable("the tokenizer is still loading")
        return self._tokenizer

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        start = time.perf_counter()
        try:
            tokenizer = self._require_tokenizer()
            encode = self._encoder(tokenizer, request, self._per_token)
            # Chat templates (jinja), long texts and images take milliseconds or more: keep the
            # loop (health checks, detokenize streams, the media store) responsive.
            ids, images = await asyncio.to_thread(encode)
        except (ValidationError, Unavailable) as exc:
            await abort_with(context, exc)  # raises grpc's AbortError
            raise
        finally:
            LATENCY.labels("tokenize").observe(time.perf_counter() - start)
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, images=images_to_pb(images))

    def _encoder(
        self, tokenizer: Any, request: tokenizer_pb2.TokenizeRequest, per_token: int | None
    ) -> Callable[[], Encoded]:
        processor = self._processor
        kind = request.WhichOneof("input")
        limit = request.max_num_tokens
        if limit < 0:
            raise ValidationError("max_num_tokens", f"must be >= 0, got {limit}")
        if kind == "text":
            text = request.text
            _check_bound(text, per_token, limit, "text")  # before the work

            def encode_text() -> Encoded:
                try:
                    with child_span(tracer, "tokenize") as span:
                        ids = tokenize_prompt(tokenizer, text)
                        span.set_attribute("llmfleet.num_tokens", len(ids))
                except ValidationError as exc:
                    raise _renamed(exc, "text") from None
                check_no_placeholder_ids(ids, processor, "text")
                _check_len(len(ids), limit, "text")
                return ids, []

            return encode_text
        if kind == "chat":
            try:
                messages = chat_messages_from_pb(request.chat.messages)
                tools = tools_from_pb(request.chat.tools)
            except ValidationError as exc:
                raise _renamed(exc, f"chat.{exc.field}") from None
            add_generation_prompt = (
                request.chat.add_generation_prompt
                if request.chat.HasField("add_generation_prompt")
                else True
            )
            if processor is not None or any(
                p.WhichOneof("part") == "image" for m in request.chat.messages for p in m.parts
            ):

                def encode_images() -> Encoded:
                    with child_span(tracer, "preprocess") as span:
                        start = time.perf_counter()
                        ids, images = self._encode_images(
                            tokenizer,
                            processor,
                            messages,
                            add_generation_prompt,
                            tools,
                            lambda text: _check_bound(text, per_token, limit, "chat.messages"),
                        )
                        seconds = time.perf_counter() - start
                        span.set_attribute("llmfleet.num_tokens", len(ids))
                        span.set_attribute("llmfleet.num_images", len(images))
                        span.set_attribute("llmfleet.preprocess_s", seconds)
                    if images:
                        PREPROCESS_SECONDS.observe(seconds)
                    _check_len(len(ids), limit, "chat.messages")
                    return ids, images

                return encode_images

            def encode_chat() -> Encoded:
                try:
                    with child_span(tracer, "render") as span:
                        span.set_attribute("llmfleet.chat.num_messages", len(messages))
                        rendered = render_chat(
                            tokenizer,
                            messages,
                            add_generation_prompt=add_generation_prompt,
                            tools=tools,
                        )
                    _check_bound(rendered, per_token, limit, "chat.messages")
                    with child_span(tracer, "tokenize") as span:
                        ids = encode_rendered(tokenizer, rendered)
                        span.set_attribute("llmfleet.num_tokens", len(ids))
                except ValidationError as exc:
                    raise _in_chat(exc) from None
                _check_len(len(ids), limit, "chat.messages")
                return ids, []

            return encode_chat
        raise ValidationError("input", "set exactly one of text or chat")

    def _encode_images(
        self,
        tokenizer: Any,
        processor: ImageProcessor | None,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]],
        check_rendered: Callable[[str], None],
    ) -> Encoded:
        """A chat through the multimodal path; its images kept in the media store."""
        try:
            prompt = encode_chat_with_images(
                tokenizer,
                processor,
                messages,
                policy=self._media.policy if self._media is not None else MediaPolicy(),
                model=self._model_name,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                check_rendered=check_rendered,
            )
            if not prompt.images:
                return prompt.token_ids, []
            if self._media is None:
                raise Unavailable("this tokenizer service has no media store")
            return prompt.token_ids, self._media.keep(prompt)
        except ValidationError as exc:
            raise _in_chat(exc) from None

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        try:
            session = DetokenizeSession(self._require_tokenizer(), self._vocab_size)
        except Unavailable as exc:
            await abort_with(context, exc)
            return
        async for request in request_iterator:
            start = time.perf_counter()
            response = session.apply(request)
            LATENCY.labels("detokenize").observe(time.perf_counter() - start)
            if response is not None:
                yield response


class TokenizerService(Service):
    """The service shell plus the media store (`media.endpoint`), closed after the drain."""

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__(
            "tokenizer",
            config.host,
            config.port,
            metrics_port=config.metrics_port,
            tls=tls.load(config.tls_dir),
        )
        self.media = MediaHost(config, self.tls)

    async def start(self, service_names: Sequence[str]) -> None:
        await super().start(service_names)
        await self.media.start()

    async def wait_for_termination(self) -> None:
        await super().wait_for_termination()
        await self.media.close()


def _service(config: TokenizerConfig) -> tuple[TokenizerService, TokenizerServicer]:
    """The service shell with the tokenizer servicer added (no tokenizer yet)."""
    svc = TokenizerService(config)
    servicer = TokenizerServicer(media=svc.media, model_name=config.model or BUNDLED_MODEL_ID)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, svc.server)
    return svc, servicer


async def start(config: TokenizerConfig, *, tokenizer: Any | None = None) -> TokenizerService:
    """Start the service and load the tokenizer (or use `tokenizer`) and the model's image
    processor (a vision-language `config.model`); returns it SERVING.

    The port is bound and health answers NOT_SERVING while the tokenizer loads. On a load
    failure the server is stopped and ModelLoadError propagates.
    """
    svc, servicer = _service(config)
    await svc.start([SERVICE_NAME])
    await _load_into(svc, servicer, config, tokenizer)
    return svc


async def _load_into(
    svc: TokenizerService,
    servicer: TokenizerServicer,
    config: TokenizerConfig,
    tokenizer: Any | None,
) -> None:
    try:
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
        processor = await asyncio.to_thread(load_image_processor, config.model, tokenizer)
    except Exception:
        await svc.server.stop(0)
        await svc.media.close()
        raise
    servicer.set_tokenizer(tokenizer, processor)
    await svc.set_serving()
    logger.info(
        "tokenizer serving on %s (vocabulary %d%s)",
        svc.address,
        len(tokenizer),
        f"; images, media store {svc.media.endpoint}" if processor is not None else "",
    )


async def serve(config: TokenizerConfig, *, tokenizer: Any | None = None) -> None:
    """Run the service until SIGTERM/SIGINT, then drain and return (the process entry point).

    Signals are handled from the start, so a SIGTERM during a slow load also ends cleanly.
    """
    svc, servicer = _service(config)
    svc.install_signal_handlers()
    await svc.start([SERVICE_NAME])
    loading = asyncio.create_task(_load_into(svc, servicer, config, tokenizer))
    stopping = asyncio.create_task(svc.wait_for_termination())
    done, _ = await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading in done and loading.exception() is not None:
        stopping.cancel()
        raise loading.exception()  # type: ignore[misc]
    if stopping in done:
        loading.cancel()
    await stopping
