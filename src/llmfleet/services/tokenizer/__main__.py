"""`python -m llmfleet.services.tokenizer [--host H] [--port P] [--metrics-port M] [--model PATH]`

Flags override `LLMFLEET_TOKENIZER_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the tokenizer cannot be
loaded, 2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.wire.service_main import run_service


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.services.tokenizer",
        description="The llmfleet tokenizer service (chat rendering, tokenization, "
        "incremental detokenization).",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument(
        "--model", default=None, help="HF checkpoint directory or .gguf file (default: bundled)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    verbose = args.pop("verbose")

    def load_serve():
        from llmfleet.services.tokenizer.server import serve

        return serve

    return run_service("tokenizer", TokenizerConfig, args, load_serve, verbose=verbose)


if __name__ == "__main__":
    sys.exit(main())
