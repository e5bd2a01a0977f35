"""The tokenizer's image flags: its own command line sets TokenizerConfig, `llmfleet up` takes
the same flags and passes them on to the tokenizer it starts, and bad values are refused."""

from __future__ import annotations

import pytest

from llmfleet.cli.parser import build_parser
from llmfleet.services.tokenizer.__main__ import SERVICE
from llmfleet.services.tokenizer.flags import media_argv
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.core.errors import ValidationError

FLAGS = [
    "--allowed-media-dir", "/srv/media",
    "--allow-remote-media",
    "--max-image-bytes", "1000",
    "--max-image-pixels", "2000",
    "--limit-images-per-prompt", "3",
    "--media-store-mb", "64",
    "--media-port", "5999",
]  # fmt: skip


def test_the_flags_set_the_tokenizer_config() -> None:
    (config,) = SERVICE.parse(FLAGS)
    assert config == TokenizerConfig(
        allowed_media_dir="/srv/media",
        allow_remote_media=True,
        max_image_bytes=1000,
        max_image_pixels=2000,
        limit_images_per_prompt=3,
        media_store_mb=64,
        media_port=5999,
    )
    (default,) = SERVICE.parse([])
    assert not default.allow_remote_media and default.allowed_media_dir is None
    assert default.limit_images_per_prompt == 8


def test_llmfleet_up_passes_them_to_the_tokenizer() -> None:
    args = build_parser().parse_args(["up", *FLAGS])
    assert media_argv(args) == FLAGS
    (config,) = SERVICE.parse(media_argv(args))
    assert config.max_image_pixels == 2000
    assert media_argv(build_parser().parse_args(["up"])) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_image_bytes", 0), ("max_image_pixels", -1), ("limit_images_per_prompt", -1),
     ("media_store_mb", 0), ("media_port", 70000)],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(field: str, value: int) -> None:
    with pytest.raises(ValidationError) as info:
        TokenizerConfig(**{field: value})
    assert info.value.field == field
