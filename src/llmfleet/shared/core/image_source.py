"""An image as a client sent it, before the tokenizer service reads it (text/media.py): the
encoded file's bytes, or a URL (a `data:` URI, a local file, or an http(s) URL)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSource:
    """Exactly one of `data` and `url` is set."""

    data: bytes = b""
    url: str = ""

    def __post_init__(self) -> None:
        if bool(self.data) == bool(self.url):
            raise ValueError("an image is either bytes or a url")

    def __repr__(self) -> str:  # never the bytes themselves (logs, errors)
        return f"ImageSource({len(self.data)} bytes)" if self.data else "ImageSource(url)"
