"""Multimodal items as the fleet passes them around: where an image's placeholder tokens sit in
a prompt and what the image is, never its pixels.

The tokenizer service decodes and preprocesses an image, expands its placeholder to `length`
tokens at `offset`, and keeps the pixel tensor in its media store under `content_hash`; the
router forwards the `ImageRef`s with the token ids; a worker fetches the pixels (ZMQ tensor
frames) only when its encoder cache lacks the hash. The content hash also enters the block
hashes of every block the placeholder run overlaps (block_hash.py), so the same image in the
same place shares KV and a different image with the same placeholder tokens never does.

`PixelInput` is what a worker's vision encoder takes: the processor's pixel tensor and its
patch grid (Qwen2-VL: (t, h, w) patches; empty for fixed-size encoders such as CLIP).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmfleet.shared.core.block_hash import MultimodalSpan


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: `length` placeholder tokens from token index `offset`."""

    content_hash: str  # hex SHA-256 (`content_hash` below)
    offset: int
    length: int
    grid: tuple[int, ...] = ()  # the processor's patch grid; () when the model has none
    media_endpoint: str = ""  # the tokenizer media store holding its pixels (tcp://host:port)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"image placeholder at {self.offset} of length {self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length

    def span(self) -> MultimodalSpan:
        return MultimodalSpan(self.offset, self.length, self.content_hash)


def mm_spans(images: Sequence[ImageRef]) -> list[MultimodalSpan]:
    """The block-hash spans of a prompt's images, in order of their offsets."""
    return [im.span() for im in sorted(images, key=lambda im: im.offset)]


def check_images(images: Sequence[ImageRef], num_prompt_tokens: int) -> None:
    """ValueError unless the placeholder runs lie inside the prompt and do not overlap."""
    end = 0
    for im in sorted(images, key=lambda im: im.offset):
        if im.offset < end or im.end > num_prompt_tokens:
            raise ValueError(
                f"image {im.content_hash[:12]} placeholder [{im.offset}, {im.end}) overlaps "
                f"another or leaves the prompt of {num_prompt_tokens} tokens"
            )
        end = im.end


@dataclass(frozen=True)
class PixelInput:
    """A preprocessed image, ready for the model's vision encoder."""

    pixel_values: Any  # torch.Tensor, the HF image processor's output for this one image
    grid: tuple[int, ...] = ()


def content_hash(dtype: str, shape: Sequence[int], data: bytes | memoryview) -> str:
    """Hex SHA-256 of a preprocessed image: its tensor's dtype name, shape and raw bytes."""
    m = hashlib.sha256(b"llmfleet-image-v1\x00")
    m.update(dtype.encode() + b"\x00")
    m.update(",".join(str(int(d)) for d in shape).encode() + b"\x00")
    m.update(data)
    return m.hexdigest()
