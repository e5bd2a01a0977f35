"""What the gateway needs from the served model's tokenizer: token spellings and prompt lengths.

The router streams token ids; OpenAI's logprobs spell each token as text plus its UTF-8
bytes. A token's text is what decoding it alone gives. A token that holds only part of a
multi-byte character decodes to U+FFFD, so its bytes come from the tokenizer's own byte
spelling instead: byte-level BPE pieces (GPT-2's printable byte alphabet, "Ġ" for a space) or
SentencePiece byte-fallback pieces ("<0xE2>").
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.text.chat import chat_images, encode_rendered, render_chat, validate_messages
from llmfleet.text.image_processing import ImageProcessor
from llmfleet.text.media import image_size
from llmfleet.text.prompt_bound import max_bytes_per_token, min_num_tokens

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_REPLACEMENT = "\ufffd"


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable character -> the byte it stands for.

    Printable Latin-1 bytes stand for themselves; every other byte b is spelled chr(256 + k),
    k counting those bytes in order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    k = 0
    for b in range(256):
        if b not in alphabet.values():
            alphabet[chr(256 + k)] = b
            k += 1
    return alphabet


class TokenSpeller:
    """Token text and bytes by id, cached; plus chat prompt lengths. Thread-safe for reads.

    `images`: the served model's image processor (None: a text-only model), to count an
    image's placeholder tokens from its size."""

    def __init__(self, tokenizer: Any, images: ImageProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._spell(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.spell(token_id)[0]

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT not in text:
            return text, list(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_PIECE.match(piece)
            if m is not None:
                return text, [int(m.group(1), 16)]
            alphabet = _byte_level_alphabet()
            if piece and all(ch in alphabet for ch in piece):
                return text, [alphabet[ch] for ch in piece]
        return text, list(text.encode("utf-8"))

    def chat_prompt_len(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        max_num_tokens: int | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        """Tokens of the chat prompt as the tokenizer service renders it (same functions).

        With `max_num_tokens` (the context length) a longer prompt is a ValidationError of
        `messages` naming its length and the limit, found before tokenizing when the cheap bound
        of text/prompt_bound.py shows it."""
        text = render_chat(
            self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        extra = self._image_tokens(messages)
        if max_num_tokens is not None and self._per_token is not None:
            at_least = min_num_tokens(text, self._per_token)
            if at_least > max_num_tokens:
                raise ValidationError(
                    "messages",
                    f"the prompt has at least {at_least} tokens, more than the context length "
                    f"of {max_num_tokens} tokens",
                )
        num = len(encode_rendered(self.tokenizer, text)) + extra
        if max_num_tokens is not None and num > max_num_tokens:
            raise ValidationError(
                "messages",
                f"the prompt has {num} tokens, more than the context length of "
                f"{max_num_tokens} tokens",
            )
        return num

    def _image_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """The tokens the images add beyond their one placeholder each in the rendered text:
        counted from inline images' sizes (their headers, not decoded); an image named by URL
        counts as the processor's largest. ValidationError for a model without images."""
        sources = chat_images(validate_messages(messages))
        if not sources:
            return 0
        if self.images is None:
            raise ValidationError(sources[0][1], "the model does not accept images")
        extra = 0
        for source, _ in sources:
            size = image_size(source.data) if source.data else None
            if size is None:  # the tokenizer service reads (and judges) it
                extra += self.images.max_num_tokens() - 1
            else:
                extra += self.images.num_tokens_for_size(*size) - 1
        return extra

    @functools.cached_property
    def _per_token(self) -> int | None:
        return max_bytes_per_token(self.tokenizer)
