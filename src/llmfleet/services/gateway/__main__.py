"""`python -m llmfleet.services.gateway [flags]` — the OpenAI-compatible HTTP gateway.

Flags override `LLMFLEET_GATEWAY_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the gateway cannot start
(port in use, tokenizer not loadable), 2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmfleet.shared.core.config import GatewayConfig
from llmfleet.shared.wire.service_main import run_service


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.services.gateway",
        description="The llmfleet OpenAI-compatible HTTP gateway (in front of the router).",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000; 0: any)")
    p.add_argument("--metrics-port", type=int, default=None, help="also serve /metrics here")
    p.add_argument("--router", dest="router_address", default=None, help="HOST:PORT")
    p.add_argument(
        "--served-model-name", default=None, help="model name for clients (default: the model id)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model's tokenizer: checkpoint dir or .gguf (default: bundled)",
    )
    p.add_argument("--request-timeout-s", type=float, default=None, help="per request")
    p.add_argument("--grace-s", type=float, default=None, help="drain time on SIGTERM")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    verbose = args.pop("verbose")

    def load_serve():
        from llmfleet.services.gateway.server import serve

        return serve

    return run_service("gateway", GatewayConfig, args, load_serve, verbose=verbose)


if __name__ == "__main__":
    sys.exit(main())
