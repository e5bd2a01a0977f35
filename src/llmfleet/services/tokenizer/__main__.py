"""`python -m llmfleet.services.tokenizer [--host H] [--port P] [--metrics-port M] [--model PATH]
[image flags: --allowed-media-dir DIR, --allow-remote-media, --max-image-bytes N, ...]`

Flags override `LLMFLEET_TOKENIZER_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the tokenizer cannot be
loaded, 2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys

from llmfleet.services.tokenizer.flags import add_media_flags
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.wire.service_main import ServiceMain
from llmfleet.shared.wire.tls import TLS_DIR_HELP


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF checkpoint directory or .gguf file (default: bundled)"
    )
    p.add_argument("--tls-dir", help=TLS_DIR_HELP)
    add_media_flags(p.add_argument_group("images (vision-language models)"))
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


SERVICE = ServiceMain(
    package="llmfleet.services.tokenizer",
    description="The llmfleet tokenizer service (chat rendering, tokenization, image "
    "preprocessing and its media store, incremental detokenization).",
    add_flags=add_flags,
    configs=(TokenizerConfig,),
    metrics_port_help="Prometheus /metrics port",
)
main = SERVICE.main
build_parser = SERVICE.build_parser  # argparse parser; for tests and `llmfleet <service>`

if __name__ == "__main__":
    sys.exit(main())
