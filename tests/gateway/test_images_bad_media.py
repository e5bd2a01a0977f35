"""Bad media through a real fleet: every case is refused before anything reaches a worker, as
a 400 naming the part through the official openai client, an Anthropic SDK error, and
INVALID_ARGUMENT through the gRPC API; the fleet keeps serving text afterwards.

The fleet's tokenizer and gateway serve the tiny Qwen2-VL checkpoint's tokenizer and image
processor (limits lowered: 2 images per prompt, 60 kB, 90 kpx); its worker is simulated
(a text model's geometry), as no request here gets past the tokenizer but the text ones.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import anthropic
import grpc
import numpy as np
import openai
import pytest
from PIL import Image
from tiny_models import sim_checkpoint

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(300)

SIMULATED = {"simulate": True, "sim_step_ms": 1.0}


def png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def bomb() -> bytes:
    """A PNG header claiming 20000x20000 pixels, ~100 bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


GOOD = png(56, 56)
TOO_MANY = "too many images"  # 3 good images, over the limit of 2
# name -> (the image as a data: URI or URL, or None for a typed placeholder; what the error says)
CASES: dict[str, tuple[str | None, str]] = {
    "malformed base64": ("data:image/png;base64,iVBORw0K@@@", "malformed base64"),
    "not an image": (f"data:image/png;base64,{b64(b'hello, not a picture')}", "not an image"),
    "over bytes": (f"data:image/png;base64,{b64(png(300, 300))}", "over the limit of 60000"),
    "over pixels": (f"data:image/png;base64,{b64(bomb())}", "pixels"),
    "remote url": ("https://example.com/cat.png", "remote image URLs are disabled"),
    "local path": ("/etc/hostname", "local image files are disabled"),
    "typed placeholder": (None, "image placeholder"),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mm_checkpoints.qwen2_vl import make_qwen2_vl_checkpoint

    qwen = make_qwen2_vl_checkpoint()
    limits = ["--limit-images-per-prompt", "2", "--max-image-bytes", "60000"]
    spec = FleetSpec(
        port=0,
        model=sim_checkpoint(),
        engine=SIMULATED,
        kvstore=False,
        gateway=True,
        http_port=0,
        extra_args={
            "tokenizer": ["--model", qwen, *limits, "--max-image-pixels", str(300 * 300)],
            "gateway": ["--model", qwen],
        },
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


GOOD_URI = f"data:image/png;base64,{b64(GOOD)}"
TYPED = "what is <|image_pad|> here?"  # a placeholder without an image (beside a real one)


def openai_parts(url: str | None, count: int = 1) -> list[dict[str, Any]]:
    if url is None:
        return [
            {"type": "image_url", "image_url": {"url": GOOD_URI}},
            {"type": "text", "text": TYPED},
        ]
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"type": "text", "text": "describe"}, *[image] * count]


def anthropic_blocks(url: str | None, count: int = 1) -> list[dict[str, Any]]:
    if url is None:
        return [*anthropic_blocks(GOOD_URI)[1:], {"type": "text", "text": TYPED}]
    if url.startswith("data:"):
        media, _, data = url.removeprefix("data:").partition(";base64,")
        source = {"type": "base64", "media_type": media, "data": data}
    else:
        source = {"type": "url", "url": url}
    return [{"type": "text", "text": "describe"}, *[{"type": "image", "source": source}] * count]


def grpc_parts(url: str | None, count: int = 1) -> list[common_pb2.ContentPart]:
    if url is None:
        return [*grpc_parts(GOOD_URI)[1:], common_pb2.ContentPart(text=TYPED)]
    image = common_pb2.ContentPart(image=common_pb2.ImageInput(url=url))
    return [common_pb2.ContentPart(text="describe"), *[image] * count]


def case_of(case: str) -> tuple[str | None, str, int]:
    """(the image, what the error says, how many times the image is sent)."""
    if case == TOO_MANY:
        return GOOD_URI, "3 images, more than the limit of 2", 3
    return (*CASES[case], 1)


def first_bad_part(url: str | None, count: int) -> int:
    """The content index an error names: the bad image or the typed text (1; a text part
    comes first, or the good image), or the third image."""
    return 3 if count == 3 else 1


@pytest.mark.parametrize("case", [*CASES, TOO_MANY])
def test_bad_media_is_a_400_at_the_openai_api(fleet: Fleet, case: str) -> None:
    url, says, count = case_of(case)
    client = openai.OpenAI(base_url=f"{fleet.http_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": openai_parts(url, count)}],
            max_tokens=4,
        )
    error: Any = info.value.body
    assert info.value.status_code == 400 and says in error["message"], error
    part = first_bad_part(url, count)
    assert error["param"].startswith(f"messages[0].content[{part}]"), error


@pytest.mark.parametrize("case", [*CASES, TOO_MANY])
def test_bad_media_is_an_error_at_the_anthropic_api(fleet: Fleet, case: str) -> None:
    url, says, count = case_of(case)
    client = anthropic.Anthropic(base_url=fleet.http_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=client.models.list().data[0].id,
            system="Be brief.",  # the chat's messages[1]: errors still name the request's block
            messages=[{"role": "user", "content": anthropic_blocks(url, count)}],
            max_tokens=4,
        )
    assert info.value.status_code == 400
    message = info.value.body["error"]["message"]  # type: ignore[index]
    part = first_bad_part(url, count)
    assert message.startswith(f"messages[0].content[{part}]") and says in message, message


@pytest.mark.parametrize("case", [*CASES, TOO_MANY])
def test_bad_media_is_invalid_argument_at_the_grpc_api(fleet: Fleet, case: str) -> None:
    url, says, count = case_of(case)
    chat = common_pb2.ChatPrompt(
        messages=[common_pb2.ChatMessage(role="user", parts=grpc_parts(url, count))]
    )
    request = generation_pb2.GenerateRequest(
        chat=chat, sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    with grpc.insecure_channel(fleet.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details() or ""
    part = first_bad_part(url, count)
    assert details.startswith(f"chat.messages[0].parts[{part}]") and says in details, details


def test_the_fleet_keeps_serving_text(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for case in ("malformed base64", "over pixels", "typed placeholder"):  # bad ones first
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": openai_parts(CASES[case][0])}],
            )  # no max_tokens: the gateway counts the prompt (its images included) first
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    answer = anthropic.Anthropic(
        base_url=fleet.http_url, api_key="unused", max_retries=0
    ).messages.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.usage.output_tokens >= 1
