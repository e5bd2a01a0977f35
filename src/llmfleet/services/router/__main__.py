"""`python -m llmfleet.services.router [flags]` — the router service.

Flags override `LLMFLEET_ROUTER_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the service cannot start,
2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmfleet.shared.core.config import ROUTING_POLICIES, RouterConfig
from llmfleet.shared.wire.service_main import run_service


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.services.router",
        description="The llmfleet router (public Generation API, routing, orchestration).",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument("--tokenizer", dest="tokenizer_address", default=None, help="HOST:PORT")
    p.add_argument("--mode", choices=["aggregated", "disaggregated"], default=None)
    p.add_argument("--routing-policy", choices=list(ROUTING_POLICIES), default=None)
    p.add_argument("--prefix-load-threshold", type=int, default=None)
    p.add_argument("--short-prompt-threshold", type=int, default=None)
    p.add_argument("--heartbeat-interval-ms", type=int, default=None)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=None)
    p.add_argument("--lease-ttl-ms", type=int, default=None)
    p.add_argument("--max-retries", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    verbose = args.pop("verbose")

    def load_serve():
        from llmfleet.services.router.server import serve

        return serve

    return run_service("router", RouterConfig, args, load_serve, verbose=verbose)


if __name__ == "__main__":
    sys.exit(main())
