"""Safe media input (text/media.py) and the chat-level refusals of text/multimodal.py: every
bad-media case is a ValidationError naming where the image was, and the good cases decode."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.media import (
    MediaPolicy,
    check_image_count,
    decode_data_uri,
    load_image,
    read_source,
)

FIELD = "messages[1].content[0]"


def png(width: int = 20, height: int = 10, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, and a tiny IDAT: a bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


DEFAULT = MediaPolicy()


def refused(source: ImageSource, policy: MediaPolicy = DEFAULT) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        load_image(source, policy, FIELD)
    assert info.value.field == FIELD
    return info.value


# ---- good images ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_images_of_each_format_decode_from_bytes_and_data_uris(fmt: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (33, 17), (10, 200, 30)).save(buf, fmt)
    raw = buf.getvalue()
    for source in (ImageSource(data=raw), ImageSource(url=data_uri(raw, f"image/{fmt.lower()}"))):
        im = load_image(source, MediaPolicy(), FIELD)
        assert im.size == (33, 17)


def test_a_data_uri_may_wrap_lines_and_omit_the_media_type() -> None:
    b64 = base64.b64encode(png()).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert decode_data_uri(f"data:image/png;base64,{wrapped}", FIELD, 1 << 20) == png()
    assert decode_data_uri(f"data:;base64,{b64}", FIELD, 1 << 20) == png()


def test_an_animated_gif_is_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    im = load_image(ImageSource(data=buf.getvalue()), MediaPolicy(), FIELD)
    assert im.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


# ---- bad images -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "data:image/png;base64,iVBORw0KGgo$$$notbase64",
        "data:image/png;base64,iVBORw0KGgo",  # bad padding
    ],
)
def test_malformed_base64_is_refused(uri: str) -> None:
    assert "malformed base64" in refused(ImageSource(url=uri)).message


def test_a_data_uri_that_is_not_base64_or_not_an_image_type_is_refused() -> None:
    assert "base64" in refused(ImageSource(url="data:image/png,rawbytes")).message
    text = data_uri(b"hello", "text/plain")
    assert "not an image type" in refused(ImageSource(url=text)).message


def test_bytes_that_are_not_an_image_are_refused() -> None:
    assert "not an image" in refused(ImageSource(data=b"%PDF-1.4 hello")).message
    assert "not an image" in refused(ImageSource(url=data_uri(b"plain text"))).message


def test_a_truncated_image_is_refused() -> None:
    raw = png(64, 64, (1, 2, 3))
    e = refused(ImageSource(data=raw[: len(raw) // 2]))
    assert "cannot be decoded" in e.message or "not an image" in e.message


def test_an_image_over_the_byte_limit_is_refused_before_decoding() -> None:
    policy = MediaPolicy(max_image_bytes=100)
    raw = png(64, 64)
    assert len(raw) > 100
    assert "over the limit of 100 bytes" in refused(ImageSource(data=raw), policy).message
    assert "over the limit of 100 bytes" in refused(ImageSource(url=data_uri(raw)), policy).message


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_an_image_over_the_pixel_limit_is_refused_from_its_header() -> None:
    start = time.perf_counter()
    e = refused(ImageSource(data=png_header_only(12000, 12000)))  # 144 Mpx in ~100 bytes
    assert "12000x12000 = 144000000 pixels, over the limit of 33554432" in e.message
    # Beyond twice Pillow's own limit, Image.open refuses it first: refused all the same.
    assert "pixels" in refused(ImageSource(data=png_header_only(30000, 30000))).message
    assert time.perf_counter() - start < 1.0  # nothing was decoded
    policy = MediaPolicy(max_image_pixels=199)
    assert "over the limit of 199" in refused(ImageSource(data=png(20, 10)), policy).message


def test_pillows_decompression_bomb_check_is_a_validation_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # bomb beyond 100 pixels
    e = refused(ImageSource(data=png(20, 10)), MediaPolicy(max_image_pixels=10**9))
    assert "too large to decode" in e.message


def test_too_many_images_are_refused() -> None:
    check_image_count(8, MediaPolicy(), "messages")
    with pytest.raises(ValidationError, match="9 images, more than the limit of 8"):
        check_image_count(9, MediaPolicy(), "messages")


# ---- local files ------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "cat.png").write_bytes(png(5, 4))
    (tmp_path / "secret.png").write_bytes(png(6, 6))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    return allowed


def test_a_local_file_under_the_allowed_directory_loads(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_media_dir=str(media_dir))
    path = media_dir / "sub" / "cat.png"
    for url in (str(path), f"file://{path}", "sub/cat.png"):
        assert load_image(ImageSource(url=url), policy, FIELD).size == (5, 4)


def test_local_files_are_refused_without_an_allowed_directory(media_dir: Path) -> None:
    e = refused(ImageSource(url=str(media_dir / "sub" / "cat.png")))
    assert "local image files are disabled" in e.message


@pytest.mark.parametrize("name", ["../secret.png", "sub/../../secret.png", "link.png"])
def test_paths_escaping_the_allowed_directory_are_refused(media_dir: Path, name: str) -> None:
    policy = MediaPolicy(allowed_media_dir=str(media_dir))
    assert "outside the allowed media directory" in refused(ImageSource(url=name), policy).message
    absolute = str(media_dir.parent / "secret.png")
    assert "outside" in refused(ImageSource(url=absolute), policy).message


def test_a_missing_file_or_an_unknown_scheme_is_refused(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_media_dir=str(media_dir))
    assert "no image file" in refused(ImageSource(url="sub/dog.png"), policy).message
    assert "no image file" in refused(ImageSource(url="sub"), policy).message
    assert "scheme 'ftp'" in refused(ImageSource(url="ftp://x/y.png"), policy).message


# ---- remote URLs ------------------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[str]:
    body = png(7, 3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/missing.png":
                self.send_error(404)
                return
            data = body * 50 if self.path == "/big.png" else body
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no Content-Length: the limit holds while reading
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_urls_are_refused_unless_enabled(http_server: str) -> None:
    e = refused(ImageSource(url=f"{http_server}/cat.png"))
    assert "remote image URLs are disabled" in e.message


def test_remote_urls_load_when_enabled_within_the_byte_limit(http_server: str) -> None:
    policy = MediaPolicy(allow_remote_media=True, max_image_bytes=len(png(7, 3)) * 10)
    assert load_image(ImageSource(url=f"{http_server}/cat.png"), policy, FIELD).size == (7, 3)
    assert "over the limit" in refused(ImageSource(url=f"{http_server}/big.png"), policy).message
    assert "HTTP 404" in refused(ImageSource(url=f"{http_server}/missing.png"), policy).message


def test_read_source_returns_the_encoded_bytes() -> None:
    raw = png()
    assert read_source(ImageSource(url=data_uri(raw)), MediaPolicy(), FIELD) == raw
    assert read_source(ImageSource(data=raw), MediaPolicy(), FIELD) == raw
