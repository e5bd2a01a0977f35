"""Chat content with images, as the gateway's two APIs send it, into the dicts of text/chat.py
(a list of {"type": "text", "text"} and {"type": "image", "image": ImageSource} parts).

OpenAI: `image_url` parts ({"url": ...} or the bare URL string). Anthropic: `image` blocks with
a `base64` source ({media_type, data}) or a `url` source. Inline images (data: URIs, base64
blocks) are decoded here, so malformed base64 is a 400 naming the part before anything is sent
on; a URL goes to the tokenizer service, which reads it only as its flags allow (a local file
under --allowed-media-dir, an http(s) URL with --allow-remote-media). Everything else about an
image (not an image, over a limit) is the tokenizer service's to refuse.
"""

from __future__ import annotations

from typing import Any

from llmfleet.services.gateway.errors import from_validation, invalid
from llmfleet.services.gateway.protocol import ChatMessage
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.media import decode_base64, decode_data_uri


def _image_part(url: Any, where: str) -> dict[str, Any]:
    """An `image_url` part: a data: URI decoded here (malformed base64 is a 400 naming the
    part), any other URL left to the tokenizer service (local files and remote URLs only as it
    allows)."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(where, f"{where}: must be {{url: string}} or a URL string")
    if url[:5].lower() == "data:":
        try:
            source = ImageSource(data=decode_data_uri(url, where, len(url)))
        except ValidationError as exc:
            raise from_validation(exc) from None
    else:
        source = ImageSource(url=url)
    return {"type": "image", "image": source}


def openai_content(m: ChatMessage, i: int) -> str | list[dict[str, Any]]:
    """A message's content: a string (text parts joined), or text and image parts in order."""
    if m.content is None:
        if m.role != "assistant":
            raise invalid(f"messages[{i}].content", "must be a string or a list of parts")
        return ""
    if isinstance(m.content, str):
        return m.content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            parts.append(_image_part(part.image_url, f"{where}.image_url"))
        else:
            raise invalid(
                where,
                f"only text and image_url content parts are supported, got type {part.type!r}",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def anthropic_image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic `image` block's part; errors are APIErrors naming `where.source...`."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}.source", f"{where}.source: must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise invalid(
                f"{where}.source.media_type",
                f"{where}.source.media_type: must be an image type, got {media_type!r}",
            )
        data = source.get("data")
        if not isinstance(data, str):
            raise invalid(f"{where}.source.data", f"{where}.source.data: must be a string")
        return {"type": "image", "image": ImageSource(data=_decoded(data, f"{where}.source.data"))}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise invalid(f"{where}.source.url", f"{where}.source.url: must be a string")
        return {"type": "image", "image": ImageSource(url=url)}
    raise invalid(
        f"{where}.source.type",
        f"{where}.source.type: must be base64 or url, got {kind!r}",
    )


def _decoded(data: str, where: str) -> bytes:
    try:
        return decode_base64(data, where, len(data))
    except ValidationError as exc:
        raise from_validation(exc) from None
