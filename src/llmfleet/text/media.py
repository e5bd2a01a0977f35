"""Safe media input: an image's bytes from where a request says it is, decoded by Pillow within
limits. Pure Python and Pillow; every refusal is a ValidationError naming where the image was
in the request (`field`, e.g. `chat.messages[1].parts[0].image`).

Where an image may come from (`MediaPolicy`):
- inline bytes, or a `data:` URI (`data:image/png;base64,...`): always;
- a local file (an absolute path, or a `file://` URL): only under `allowed_media_dir`, after
  resolving `..` and symlinks (a link pointing out of the directory is refused);
- an `http(s)://` URL: only with `allow_remote_media`, read with a timeout and never more than
  `max_image_bytes`.

Limits: `max_image_bytes` of encoded image; `max_image_pixels` (width x height) read from the
header before anything is decoded (the decompression-bomb guard; Pillow's own bomb check is
answered the same way); `limit_images_per_prompt`. Only common still-image formats are opened
(`FORMATS`); an animated image is its first frame. A truncated or undecodable file is refused.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),", re.DOTALL)
_REMOTE_CHUNK = 1 << 16


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (the tokenizer's flags)."""

    allowed_media_dir: str | None = None  # local files under this directory; None: none
    allow_remote_media: bool = False  # http(s) URLs
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 32 * 1024 * 1024
    limit_images_per_prompt: int = 8
    remote_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "remote_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValidationError(name, f"must be > 0, got {getattr(self, name)}")
        if self.limit_images_per_prompt < 0:
            raise ValidationError("limit_images_per_prompt", "must be >= 0")


def check_image_count(num_images: int, policy: MediaPolicy, field: str) -> None:
    if num_images > policy.limit_images_per_prompt:
        raise ValidationError(
            field,
            f"{num_images} images, more than the limit of {policy.limit_images_per_prompt} "
            "per prompt",
        )


def decode_data_uri(uri: str, field: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URI of an image (or with no media type)."""
    m = _DATA_URI.match(uri)
    if m is None:
        raise ValidationError(field, "not a data: URI (data:image/<type>;base64,<data>)")
    mime, params = m.group("mime"), m.group("params") or ""
    if mime and not mime.lower().startswith("image/"):
        raise ValidationError(field, f"media type {mime!r} is not an image type")
    if "base64" not in [p.strip().lower() for p in params.split(";")]:
        raise ValidationError(field, "only base64 data: URIs are accepted")
    return decode_base64(uri[m.end() :], field, max_bytes)


def decode_base64(text: str, field: str, max_bytes: int) -> bytes:
    """Strict base64 (whitespace allowed); refused before decoding when it is over `max_bytes`."""
    compact = "".join(text.split())
    if len(compact) // 4 * 3 > max_bytes + 2:
        raise ValidationError(field, f"the image is over the limit of {max_bytes} bytes")
    try:
        raw = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValidationError(field, f"malformed base64: {e}") from None
    if not raw:
        raise ValidationError(field, "the image is empty")
    _check_size(len(raw), max_bytes, field)
    return raw


def read_source(source: ImageSource, policy: MediaPolicy, field: str) -> bytes:
    """The encoded image bytes of `source`, within `policy`."""
    if source.data:
        _check_size(len(source.data), policy.max_image_bytes, field)
        return source.data
    url = source.url.strip()
    scheme = urllib.parse.urlsplit(url).scheme.lower() if ":" in url[:8] else ""
    if scheme == "data":
        return decode_data_uri(url, field, policy.max_image_bytes)
    if scheme in ("http", "https"):
        if not policy.allow_remote_media:
            raise ValidationError(
                field,
                "remote image URLs are disabled (use a data: URI, or start the tokenizer with "
                "--allow-remote-media)",
            )
        return _read_remote(url, policy, field)
    if scheme == "file":
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValidationError(field, "file: URLs must name a local file")
        return _read_local(urllib.parse.unquote(parsed.path), policy, field)
    if scheme or not url:
        raise ValidationError(field, f"unsupported image URL scheme {scheme!r}")
    return _read_local(url, policy, field)


def open_image(raw: bytes, policy: MediaPolicy, field: str) -> Image.Image:
    """Decode `raw` (fully loaded; the first frame of an animation) within the pixel limit."""
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as im:
            width, height = im.size
            if width < 1 or height < 1:
                raise ValidationError(field, f"the image has no pixels ({width}x{height})")
            if width * height > policy.max_image_pixels:
                raise ValidationError(
                    field,
                    f"the image is {width}x{height} = {width * height} pixels, over the limit "
                    f"of {policy.max_image_pixels}",
                )
            im.seek(0)
            im.load()
            return im.copy()
    except ValidationError:
        raise
    except Image.DecompressionBombError as e:
        raise ValidationError(field, f"the image is too large to decode: {e}") from None
    except UnidentifiedImageError:
        raise ValidationError(field, f"not an image (or not one of {', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        # Truncated or corrupt data: Pillow raises OSError ("image file is truncated"),
        # SyntaxError (broken PNG chunks), ValueError or EOFError depending on the format.
        raise ValidationError(field, f"the image cannot be decoded: {e}") from None


def image_size(raw: bytes) -> tuple[int, int] | None:
    """(width, height) from an image's header, nothing decoded; None when it is not one."""
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as im:
            return im.size
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        return None


def load_image(source: ImageSource, policy: MediaPolicy, field: str) -> Image.Image:
    return open_image(read_source(source, policy, field), policy, field)


def _check_size(num_bytes: int, max_bytes: int, field: str) -> None:
    if num_bytes > max_bytes:
        raise ValidationError(
            field, f"the image is {num_bytes} bytes, over the limit of {max_bytes} bytes"
        )


def _read_local(path: str, policy: MediaPolicy, field: str) -> bytes:
    if policy.allowed_media_dir is None:
        raise ValidationError(
            field,
            "local image files are disabled (use a data: URI, or start the tokenizer with "
            "--allowed-media-dir)",
        )
    root = Path(policy.allowed_media_dir).resolve()
    try:
        # Symlinks and `..` resolved first; an absolute `path` replaces `root`.
        resolved = (root / path).resolve()
    except (OSError, RuntimeError):
        raise ValidationError(field, f"{path} cannot be resolved") from None
    if not resolved.is_relative_to(root):
        raise ValidationError(field, f"{path} is outside the allowed media directory")
    if not resolved.is_file():
        raise ValidationError(field, f"no image file {path} in the allowed media directory")
    with resolved.open("rb") as f:
        raw = f.read(policy.max_image_bytes + 1)
    _check_size(len(raw), policy.max_image_bytes, field)
    return raw


def _read_remote(url: str, policy: MediaPolicy, field: str) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "llmfleet-tokenizer"})
    chunks: list[bytes] = []
    total = 0
    try:
        with urllib.request.urlopen(request, timeout=policy.remote_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit():
                _check_size(int(length), policy.max_image_bytes, field)
            while chunk := resp.read(_REMOTE_CHUNK):
                total += len(chunk)
                _check_size(total, policy.max_image_bytes, field)
                chunks.append(chunk)
    except ValidationError:
        raise
    except urllib.error.HTTPError as e:
        raise ValidationError(field, f"fetching the image failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValidationError(field, f"fetching the image failed: {e}") from None
    return b"".join(chunks)
