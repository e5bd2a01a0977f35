"""`python -m llmfleet.services.gateway [flags]` — the OpenAI-compatible HTTP gateway.

Flags override `LLMFLEET_GATEWAY_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the gateway cannot start
(port in use, tokenizer not loadable), 2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys

from llmfleet.shared.core.api_keys import add_api_key_flag
from llmfleet.shared.core.config import AuthConfig, GatewayConfig
from llmfleet.shared.wire.service_main import ServiceMain


def add_flags(p: argparse.ArgumentParser) -> None:
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
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 unread (default 16 MiB)",
    )
    p.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=None,
        help="/v1/responses kept for GET and previous_response_id (default 10000; 0: none)",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=None,
        help="their total JSON size (default 256 MiB; the oldest leave first)",
    )
    p.add_argument(
        "--responses-store-ttl-s", type=float, default=None, help="how long each is kept (3600)"
    )
    add_api_key_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


SERVICE = ServiceMain(
    package="llmfleet.services.gateway",
    description="The llmfleet OpenAI-compatible HTTP gateway (in front of the router).",
    add_flags=add_flags,
    configs=(GatewayConfig, AuthConfig),
    port_help="HTTP port (default 8000; 0: any)",
    metrics_port_help="also serve /metrics here",
)
main = SERVICE.main
build_parser = SERVICE.build_parser  # argparse parser; for tests and `llmfleet <service>`

if __name__ == "__main__":
    sys.exit(main())
