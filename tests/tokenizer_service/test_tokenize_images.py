"""The tokenizer service with images: Tokenize over loopback gRPC returns the expanded token ids
and ImageRefs, the pixels are fetched from its media store over ZMQ, and bad media is
INVALID_ARGUMENT naming the request's part."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import prometheus_client
import pytest
import torch
from PIL import Image

from llmfleet.services.tokenizer.server import start
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.shared.wire.media import MediaClient
from llmfleet.text.loading import load_tokenizer
from llmfleet.text.media import MediaPolicy
from llmfleet.text.multimodal import encode_chat_with_images
from llmfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def image_part(*, data: bytes = b"", url: str = "") -> common_pb2.ContentPart:
    image = common_pb2.ImageInput(data=data) if data else common_pb2.ImageInput(url=url)
    return common_pb2.ContentPart(image=image)


def request(*parts: common_pb2.ContentPart, limit: int = 0) -> tokenizer_pb2.TokenizeRequest:
    chat = common_pb2.ChatPrompt(
        messages=[
            common_pb2.ChatMessage(role="system", content="Be brief."),
            common_pb2.ChatMessage(role="user", parts=list(parts)),
        ]
    )
    return tokenizer_pb2.TokenizeRequest(chat=chat, max_num_tokens=limit)


def text(t: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=t)


@asynccontextmanager
async def serving(model: str, **cfg: Any) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    svc = await start(TokenizerConfig(port=0, model=model, **cfg))
    channel = grpc.aio.insecure_channel(svc.address)
    try:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)
    finally:
        await channel.close()
        svc.request_stop()
        await svc.wait_for_termination()


async def invalid(stub: tokenizer_pb2_grpc.TokenizerStub, req: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details() or ""


@pytest.fixture(scope="module")
def qwen() -> str:
    from mm_checkpoints.qwen2_vl import make_qwen2_vl_checkpoint

    return make_qwen2_vl_checkpoint()


def test_tokenize_returns_image_refs_and_the_media_store_serves_their_pixels(qwen: str) -> None:
    a, b = png(56, 56, 1), png(112, 84, 2)
    b64 = base64.b64encode(b).decode()
    tokenizer = load_tokenizer(qwen)
    from llmfleet.text.image_processing import load_image_processor

    expected = encode_chat_with_images(
        tokenizer,
        load_image_processor(qwen, tokenizer),
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": ImageSource(data=a)},
                    {"type": "text", "text": "vs"},
                    {"type": "image", "image": ImageSource(data=b)},
                ],
            },
        ],
        policy=MediaPolicy(),
        model="q",
    )

    async def body() -> None:
        async with serving(qwen) as stub:
            req = request(
                image_part(data=a), text("vs"), image_part(url=f"data:image/png;base64,{b64}")
            )
            got = await stub.Tokenize(req)
            assert list(got.token_ids) == expected.token_ids
            assert [(i.offset, i.length, tuple(i.grid)) for i in got.images] == [
                (e.offset, e.length, e.pixel.grid) for e in expected.images
            ]
            assert [i.content_hash for i in got.images] == [e.content_hash for e in expected.images]
            endpoint = got.images[0].media_endpoint
            assert endpoint.startswith("tcp://127.0.0.1:")
            async with MediaClient(timeout_s=5) as client:
                pixels = await client.fetch(endpoint, [i.content_hash for i in got.images])
            for e in expected.images:
                assert torch.equal(pixels[e.content_hash].pixel_values, e.pixel.pixel_values)
                assert pixels[e.content_hash].grid == e.pixel.grid
            # A text-only chat of a VLM has no images.
            plain = tokenizer_pb2.TokenizeRequest(
                chat=common_pb2.ChatPrompt(
                    messages=[common_pb2.ChatMessage(role="user", content="hi")]
                )
            )
            assert not (await stub.Tokenize(plain)).images

    asyncio.run(body())
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("llmfleet:tokenizer_preprocess_seconds_count") >= 1
    assert registry.get_sample_value("llmfleet:media_store_fetches_total", {"result": "hit"}) >= 2


def test_bad_media_is_invalid_argument_naming_the_part(qwen: str, tmp_path: Path) -> None:
    good = png(56, 56, 1)
    (tmp_path / "ok.png").write_bytes(good)

    async def body() -> None:
        async with serving(qwen, limit_images_per_prompt=2, max_image_bytes=50_000) as stub:
            cases = {
                "chat.messages[1].parts[2]: malformed base64": request(
                    text("a"), image_part(data=good), image_part(url="data:image/png;base64,@@")
                ),
                "chat.messages[1].parts[0]: not an image": request(image_part(data=b"GIF89a no")),
                "chat.messages[1].parts[0]: the image is": request(
                    image_part(data=png(300, 300, 3))  # ~270 kB, over 50 kB
                ),
                "chat.messages[1].parts[0]: remote image URLs are disabled": request(
                    image_part(url="https://example.com/cat.png")
                ),
                "chat.messages[1].parts[0]: local image files are disabled": request(
                    image_part(url=str(tmp_path / "ok.png"))
                ),
                "chat.messages[1].parts[2]: 3 images, more than the limit of 2": request(
                    *(image_part(data=good) for _ in range(3))
                ),
                "chat.messages[1].parts[1]: contains the image placeholder": request(
                    image_part(data=good), text("<|image_pad|>")
                ),
                "chat.messages[1].parts[0].image: the image is empty": request(
                    common_pb2.ContentPart(image=common_pb2.ImageInput(url=""))
                ),
                "chat.messages[1].parts[0]: set text, or image": request(common_pb2.ContentPart()),
            }
            for prefix, req in cases.items():
                details = await invalid(stub, req)
                assert details.startswith(prefix), (prefix, details)
            # The context length counts the images' tokens; a long text is refused by the bound.
            # (41 tokens with the image's one placeholder, 44 expanded to its 4 tokens)
            details = await invalid(stub, request(image_part(data=good), limit=42))
            assert details == (
                "chat.messages: the prompt has 44 tokens, more than the context length of 42 tokens"
            )
            details = await invalid(stub, request(text("x" * 5000), limit=20))
            assert details.startswith("chat.messages: the prompt has at least")
            raw = tokenizer_pb2.TokenizeRequest(text="see <|image_pad|>")
            assert (await invalid(stub, raw)).startswith("text: contains image placeholder")
            # The service keeps serving.
            got = await stub.Tokenize(request(image_part(data=good)))
            assert len(got.images) == 1

    asyncio.run(body())


def test_local_files_under_the_allowed_directory(qwen: str, tmp_path: Path) -> None:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "ok.png").write_bytes(png(56, 56, 1))
    (tmp_path / "secret.png").write_bytes(png(56, 56, 2))

    async def body() -> None:
        async with serving(qwen, allowed_media_dir=str(tmp_path / "media")) as stub:
            got = await stub.Tokenize(request(image_part(url=str(tmp_path / "media" / "ok.png"))))
            assert [i.length for i in got.images] == [4]
            details = await invalid(stub, request(image_part(url="../secret.png")))
            assert "outside the allowed media directory" in details

    asyncio.run(body())


def test_a_text_only_model_refuses_images(make_checkpoint: Any, tmp_path: Path) -> None:
    path = str(make_checkpoint("llama", tmp_path))

    async def body() -> None:
        async with serving(path) as stub:
            details = await invalid(stub, request(text("x"), image_part(data=png(8, 8, 1))))
            assert details == f"chat.messages[1].parts[1]: model {path} does not accept images"

    asyncio.run(body())


def test_preprocessing_is_a_span_of_the_tokenize_call(qwen: str) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llmfleet.shared.wire.tracing import metadata

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # one global provider per process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def body() -> None:
        async with serving(qwen) as stub:
            with trace.get_tracer("test").start_as_current_span("client"):
                await stub.Tokenize(
                    request(image_part(data=png(56, 56, 1)), image_part(data=png(56, 56, 2))),
                    metadata=metadata(),
                )

    try:
        asyncio.run(body())
        spans = {s.name: s for s in exporter.get_finished_spans()}
        rpc, pre = spans["llmfleet.v1.Tokenizer/Tokenize"], spans["preprocess"]
        assert pre.parent is not None and pre.parent.span_id == rpc.context.span_id
        assert pre.attributes["llmfleet.num_images"] == 2
        assert pre.attributes["llmfleet.preprocess_s"] > 0
    finally:
        exporter.shutdown()
