"""The tokenizer service's image flags, shared by its own command line and `llmfleet up`
(which passes them on to the tokenizer it starts). Each flag's dest is a TokenizerConfig
field; a flag not given is None (the environment or the default applies)."""

from __future__ import annotations

import argparse
from typing import Any

# TokenizerConfig fields set by these flags, in order.
MEDIA_FIELDS = (
    "allowed_media_dir",
    "allow_remote_media",
    "max_image_bytes",
    "max_image_pixels",
    "limit_images_per_prompt",
    "media_store_mb",
    "media_port",
)


def add_media_flags(p: Any) -> None:
    """Add the flags to an argparse parser or argument group."""
    p.add_argument(
        "--allowed-media-dir",
        metavar="DIR",
        help="image files may be named by path only under this directory (default: none)",
    )
    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        default=None,
        help="fetch http(s) image URLs (default: off; data: URIs and inline bytes only)",
    )
    p.add_argument(
        "--max-image-bytes", type=int, metavar="N", help="largest encoded image (default 20 MiB)"
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        metavar="N",
        help="largest image, width x height, checked before decoding (default 32 Mi)",
    )
    p.add_argument(
        "--limit-images-per-prompt", type=int, metavar="N", help="images per prompt (default 8)"
    )
    p.add_argument(
        "--media-store-mb",
        type=int,
        metavar="MIB",
        help="preprocessed pixels kept for workers to fetch, LRU (default 1024)",
    )
    p.add_argument(
        "--media-port",
        type=int,
        metavar="PORT",
        help="ZMQ port of the media store (default 0: any free port)",
    )


def media_argv(args: argparse.Namespace) -> list[str]:
    """The flags given in `args`, as a tokenizer command line's arguments."""
    out: list[str] = []
    for name in MEDIA_FIELDS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out
