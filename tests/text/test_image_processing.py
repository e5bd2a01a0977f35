"""Image preprocessing and placeholder expansion (text/image_processing.py, text/multimodal.py)
against transformers on the tiny checkpoints of tests/mm_checkpoints: the token ids and pixel
values equal what HF's processors make of the same chat, content hashes identify images."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.image_processing import ImageProcessor, load_image_processor, pixel_hash
from llmfleet.text.loading import load_tokenizer
from llmfleet.text.media import MediaPolicy
from llmfleet.text.multimodal import MultimodalPrompt, encode_chat_with_images

pytestmark = pytest.mark.timeout(120)

MODELS = ("llava-clip", "llava-siglip", "qwen2_vl")


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def encoded(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, str]:
    from mm_checkpoints.llava import make_llava_checkpoint
    from mm_checkpoints.qwen2_vl import make_qwen2_vl_checkpoint

    return {
        "llava-clip": make_llava_checkpoint("clip"),
        "llava-siglip": make_llava_checkpoint("siglip"),
        "qwen2_vl": make_qwen2_vl_checkpoint(),
    }


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, str]) -> dict[str, tuple[Any, ImageProcessor]]:
    out = {}
    for name, path in checkpoints.items():
        tokenizer = load_tokenizer(path)
        processor = load_image_processor(path, tokenizer)
        assert processor is not None
        out[name] = (tokenizer, processor)
    return out


def chat(images: list[bytes], text: str = "What is here?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Look: "}]
    for raw in images:
        parts.append({"type": "image", "image": ImageSource(data=raw)})
        parts.append({"type": "text", "text": " and "})
    parts.append({"type": "text", "text": text})
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


def hf_reference(name: str, path: str, images: list[Image.Image]) -> dict[str, Any]:
    """What HF's processor makes of the same chat: input_ids and pixel_values (+ grids)."""
    hf_chat = [
        {
            **m,
            "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in chat([b"x"] * len(images))
    ]
    if name == "qwen2_vl":
        # Qwen2VLProcessor needs torchvision (its video processor); the checkpoint module's
        # `processor_inputs` is the same computation: AutoImageProcessor + the expansion.
        from mm_checkpoints.qwen2_vl import processor_inputs
        from transformers import AutoTokenizer

        text = AutoTokenizer.from_pretrained(path).apply_chat_template(
            hf_chat, add_generation_prompt=True, tokenize=False
        )
        return processor_inputs(path, text, images)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(hf_chat, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


def ours(loaded: dict[str, tuple[Any, ImageProcessor]], name: str, raw: list[bytes]) -> Any:
    tokenizer, processor = loaded[name]
    return encode_chat_with_images(
        tokenizer, processor, chat(raw), policy=MediaPolicy(), model=name
    )


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_token_ids_and_pixels_equal_transformers(
    checkpoints: dict[str, str],
    loaded: dict[str, tuple[Any, ImageProcessor]],
    name: str,
    num_images: int,
) -> None:
    images = [picture(56, 56, 1), picture(112, 84, 2)][:num_images]
    prompt = ours(loaded, name, [encoded(im) for im in images])
    ref = hf_reference(name, checkpoints[name], images)
    assert prompt.token_ids == ref["input_ids"][0].tolist()
    assert len(prompt.images) == num_images
    if not num_images:
        return
    token = loaded[name][1].image_token_id
    if name == "qwen2_vl":
        grids = ref["image_grid_thw"].tolist()
        rows = torch.split(ref["pixel_values"], [t * h * w for t, h, w in grids])
    else:
        grids = [[]] * num_images
        rows = torch.split(ref["pixel_values"], 1)
    for image, grid, expected in zip(prompt.images, grids, rows, strict=True):
        assert image.pixel.grid == tuple(grid)
        assert image.pixel.pixel_values.dtype == torch.float32
        assert torch.equal(image.pixel.pixel_values, expected)
        run = prompt.token_ids[image.offset : image.offset + image.length]
        assert run == [token] * image.length
        assert image.content_hash == pixel_hash(image.pixel)
    # Placeholders are exactly the images' runs.
    assert prompt.token_ids.count(token) == sum(im.length for im in prompt.images)


def test_placeholder_counts_follow_the_processors(
    loaded: dict[str, tuple[Any, ImageProcessor]],
) -> None:
    raw = [encoded(picture(56, 56, 1)), encoded(picture(112, 84, 2))]
    # LLaVA: 28x28 crops, 14x14 patches: 4 tokens (CLIP's class token dropped; SigLIP has none).
    for name in ("llava-clip", "llava-siglip"):
        assert [im.length for im in ours(loaded, name, raw).images] == [4, 4]
    # Qwen2-VL: (1, 4, 4) and (1, 6, 8) patch grids (t, h, w), merged 2x2: 4 and 12 tokens.
    qwen = ours(loaded, "qwen2_vl", raw).images
    assert [im.pixel.grid for im in qwen] == [(1, 4, 4), (1, 6, 8)]
    assert [im.length for im in qwen] == [4, 12]


def test_content_hash_identifies_the_pixels(loaded: dict[str, tuple[Any, ImageProcessor]]) -> None:
    a, b = picture(56, 56, 1), picture(56, 56, 7)  # same size, different content
    for name in MODELS:
        first = ours(loaded, name, [encoded(a)]).images[0]
        again = ours(loaded, name, [encoded(a, "BMP")]).images[0]  # same pixels, other file
        other = ours(loaded, name, [encoded(b)]).images[0]
        assert first.content_hash == again.content_hash
        assert first.content_hash != other.content_hash
        assert (first.offset, first.length) == (other.offset, other.length)
        assert len(first.content_hash) == 64


def refused(loaded: Any, name: str, messages: list[dict[str, Any]], **policy: Any) -> str:
    tokenizer, processor = loaded[name] if name in loaded else (loaded["text"], None)
    with pytest.raises(ValidationError) as info:
        encode_chat_with_images(
            tokenizer, processor, messages, policy=MediaPolicy(**policy), model=name
        )
    return str(info.value)


@pytest.mark.parametrize(
    ("name", "typed"),
    [("llava-clip", "<image>"), ("qwen2_vl", "<|image_pad|>"), ("qwen2_vl", "<|vision_start|>")],
)
def test_placeholder_tokens_typed_without_an_image_are_refused(
    loaded: dict[str, tuple[Any, ImageProcessor]], name: str, typed: str
) -> None:
    text_only = [{"role": "user", "content": f"what is {typed} here?"}]
    assert refused(loaded, name, text_only).startswith("messages[0].content: contains the image")
    # ... also beside a real image: the typed one names its text part.
    messages = chat([encoded(picture(56, 56, 1))], text=f"and {typed}?")
    assert refused(loaded, name, messages).startswith("messages[1].content[3]: contains")


def test_too_many_images_name_the_first_one_over_the_limit(
    loaded: dict[str, tuple[Any, ImageProcessor]],
) -> None:
    raw = [encoded(picture(56, 56, i)) for i in range(3)]
    error = refused(loaded, "qwen2_vl", chat(raw), limit_images_per_prompt=2)
    assert error == "messages[1].content[5]: 3 images, more than the limit of 2 per prompt"


def test_a_bad_image_names_its_part(loaded: dict[str, tuple[Any, ImageProcessor]]) -> None:
    messages = chat([encoded(picture(56, 56, 1)), b"not an image"])
    assert refused(loaded, "llava-clip", messages).startswith("messages[1].content[3]: not an")


def test_a_text_only_model_does_not_accept_images(make_checkpoint: Any, tmp_path: Any) -> None:
    path = make_checkpoint("llama", tmp_path)
    tokenizer = load_tokenizer(str(path))
    assert load_image_processor(str(path), tokenizer) is None
    messages = chat([encoded(picture(56, 56, 1))])
    error = refused({"text": tokenizer}, "tiny-llama", messages)
    assert error == "messages[1].content[1]: model tiny-llama does not accept images"
    # Text-only parts still render as one string.
    plain = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    prompt = encode_chat_with_images(
        tokenizer, None, plain, policy=MediaPolicy(), model="tiny-llama"
    )
    assert isinstance(prompt, MultimodalPrompt) and prompt.images == []
    assert tokenizer.decode(prompt.token_ids).count("ab") == 1


def test_token_counts_from_the_size_alone_equal_the_preprocessed_ones(
    loaded: dict[str, tuple[Any, ImageProcessor]],
) -> None:
    for name in MODELS:
        processor = loaded[name][1]
        for width, height in ((56, 56), (112, 84), (30, 200), (400, 90)):
            pixel = processor.preprocess(picture(width, height, 0))
            assert processor.num_tokens_for_size(width, height) == processor.num_tokens(pixel)
