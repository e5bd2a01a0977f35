"""An image in a chat through the gateway and a real fleet (tiny LLaVA checkpoint on CPU
workers): the official openai and anthropic SDKs send one and get an answer, and the prompt's
token count is the one transformers' processor makes of the same chat (each image's
placeholder expanded). The gateway's own count for a default max_tokens agrees."""

from __future__ import annotations

import base64
import io
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.services.gateway.tokens import TokenSpeller
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.image_processing import load_image_processor
from llmfleet.text.loading import load_tokenizer
from llmfleet.text.media import MediaPolicy
from llmfleet.text.multimodal import encode_chat_with_images

pytestmark = pytest.mark.timeout(300)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


IMAGE = png(40, 30, 3)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def checkpoint() -> str:
    from mm_checkpoints.llava import make_llava_checkpoint

    return make_llava_checkpoint("clip")


@pytest.fixture(scope="module")
def fleet(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    spec = FleetSpec(
        port=0,
        model=checkpoint,
        kvstore=False,
        gateway=True,
        http_port=0,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


def hf_prompt_len(checkpoint: str, num_images: int) -> int:
    """Tokens of the user turn [images..., QUESTION] as transformers' LlavaProcessor makes it."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.open(io.BytesIO(IMAGE))] * num_images
    return int(processor(text=[text], images=images, return_tensors="pt")["input_ids"].shape[1])


def test_the_openai_sdk_sends_an_image_and_gets_an_answer(fleet: Fleet, checkpoint: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet.http_url}/v1", api_key="unused", max_retries=0)
    url = f"data:image/png;base64,{base64.b64encode(IMAGE).decode()}"
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=6,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    assert reply.usage.prompt_tokens == hf_prompt_len(checkpoint, 1)


def test_the_anthropic_sdk_sends_an_image_and_gets_an_answer(fleet: Fleet, checkpoint: str) -> None:
    client = anthropic.Anthropic(base_url=fleet.http_url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()}
    image = {"type": "image", "source": source}
    answer = client.messages.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": [image, image, {"type": "text", "text": QUESTION}]}],
        max_tokens=6,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.output_tokens >= 1
    assert answer.usage.input_tokens == hf_prompt_len(checkpoint, 2)


def test_the_gateways_prompt_count_includes_the_images_tokens(checkpoint: str) -> None:
    tokenizer = load_tokenizer(checkpoint)
    processor = load_image_processor(checkpoint, tokenizer)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": ImageSource(data=IMAGE)},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    speller = TokenSpeller(tokenizer, processor)
    prompt = encode_chat_with_images(
        tokenizer, processor, messages, policy=MediaPolicy(), model="m"
    )
    assert (
        speller.chat_prompt_len(messages) == len(prompt.token_ids) == hf_prompt_len(checkpoint, 1)
    )
