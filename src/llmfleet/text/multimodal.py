"""A chat prompt with images to token ids and preprocessed images: the tokenizer service's
multimodal path, pure (no gRPC, no store).

    prompt = encode_chat_with_images(tokenizer, processor, messages, policy=policy, model="m")
    prompt.token_ids        # each image's one placeholder expanded to its token count
    prompt.images           # PreparedImage per image, in prompt order: pixels, hash, offset

Steps, cheapest checks first: the image count against the per-prompt limit; the model takes
images at all; no text of the chat holds a placeholder token's text (it would pass for an
image); the template renders the chat (an image part is `{"type": "image"}`) and the text is
tokenized; each image is read and decoded within the policy's limits, run through the model's
image processor and hashed; the rendered prompt's placeholder tokens (exactly one per image,
else ValidationError) are expanded to each image's count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef, PixelInput
from llmfleet.text.chat import (
    chat_images,
    chat_texts,
    encode_rendered,
    render_chat,
    validate_messages,
)
from llmfleet.text.image_processing import ImageProcessor, pixel_hash
from llmfleet.text.media import MediaPolicy, check_image_count, load_image


@dataclass(frozen=True)
class PreparedImage:
    """One preprocessed image of a prompt and where its placeholder run is."""

    pixel: PixelInput
    content_hash: str
    offset: int
    length: int
    field: str  # where it was in the request (`messages[i].content[j]`)

    def ref(self, media_endpoint: str) -> ImageRef:
        return ImageRef(
            content_hash=self.content_hash,
            offset=self.offset,
            length=self.length,
            grid=self.pixel.grid,
            media_endpoint=media_endpoint,
        )


@dataclass(frozen=True)
class MultimodalPrompt:
    token_ids: list[int]
    images: list[PreparedImage]


def check_no_placeholder_text(text: str, processor: ImageProcessor | None, field: str) -> None:
    """ValidationError when `text` holds an image placeholder token's text: a placeholder
    without an image."""
    if processor is None:
        return
    for reserved in processor.rule.reserved_texts:
        if reserved in text:
            raise ValidationError(
                field, f"contains the image placeholder {reserved!r} without an image"
            )


def check_no_placeholder_ids(
    ids: Sequence[int], processor: ImageProcessor | None, field: str
) -> None:
    """ValidationError when token ids hold the image placeholder (a prompt without images)."""
    if processor is not None and processor.image_token_id in ids:
        raise ValidationError(
            field,
            f"contains image placeholder token {processor.image_token_id} without an image",
        )


def encode_chat_with_images(
    tokenizer: Any,
    processor: ImageProcessor | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    policy: MediaPolicy,
    model: str,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] = (),
    check_rendered: Callable[[str], None] | None = None,
) -> MultimodalPrompt:
    """Token ids and preprocessed images of a chat (see the module docstring). Errors name
    fields as `validate_messages` does (`messages[1].content[0]`). `check_rendered` sees the
    rendered text before it is tokenized (a cheap length bound)."""
    checked = validate_messages(messages)
    sources = chat_images(checked)
    limit = policy.limit_images_per_prompt
    if len(sources) > limit:
        check_image_count(len(sources), policy, sources[limit][1])
    if sources and processor is None:
        raise ValidationError(sources[0][1], f"model {model} does not accept images")
    for text, where in chat_texts(checked):
        check_no_placeholder_text(text, processor, where)
    rendered = render_chat(
        tokenizer, checked, add_generation_prompt=add_generation_prompt, tools=tools
    )
    if check_rendered is not None:
        check_rendered(rendered)
    ids = encode_rendered(tokenizer, rendered)
    if processor is None or not sources:
        check_no_placeholder_ids(ids, processor, "messages")
        return MultimodalPrompt(ids, [])
    pixels = [
        (processor.preprocess(load_image(source, policy, where)), where)
        for source, where in sources
    ]
    return expand_placeholders(ids, processor, pixels)


def expand_placeholders(
    ids: Sequence[int], processor: ImageProcessor, pixels: Sequence[tuple[PixelInput, str]]
) -> MultimodalPrompt:
    """Each image's single placeholder token in `ids` (in order) expanded to its token count."""
    token = processor.image_token_id
    found = [k for k, t in enumerate(ids) if t == token]
    if len(found) != len(pixels):
        raise ValidationError(
            "messages",
            f"the rendered prompt has {len(found)} image placeholders for {len(pixels)} images "
            "(does the chat template render image parts?)",
        )
    out: list[int] = []
    images = []
    start = 0
    for k, (pixel, where) in zip(found, pixels, strict=True):
        out.extend(ids[start:k])
        n = processor.num_tokens(pixel)
        images.append(PreparedImage(pixel, pixel_hash(pixel), len(out), n, where))
        out.extend([token] * n)
        start = k + 1
    out.extend(ids[start:])
    return MultimodalPrompt(out, images)
