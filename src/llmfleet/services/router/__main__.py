"""`python -m llmfleet.services.router [flags]` — the router service.

Flags override `LLMFLEET_ROUTER_*` environment variables. Logs go to stderr; nothing is
printed to stdout. Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the service cannot start,
2 on a bad flag or configuration value.
"""

from __future__ import annotations

import argparse
import sys

from llmfleet.shared.core.api_keys import add_api_key_flag
from llmfleet.shared.core.config import ROUTING_POLICIES, AuthConfig, RouterConfig
from llmfleet.shared.wire.service_main import ServiceMain
from llmfleet.shared.wire.tls import TLS_DIR_HELP


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", dest="tokenizer_address", default=None, help="HOST:PORT")
    p.add_argument("--mode", choices=["aggregated", "disaggregated"], default=None)
    p.add_argument("--routing-policy", choices=list(ROUTING_POLICIES), default=None)
    p.add_argument("--prefix-load-threshold", type=int, default=None)
    p.add_argument("--short-prompt-threshold", type=int, default=None)
    p.add_argument("--heartbeat-interval-ms", type=int, default=None)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=None)
    p.add_argument("--lease-ttl-ms", type=int, default=None)
    p.add_argument("--max-retries", type=int, default=None)
    p.add_argument(
        "--max-prefills-per-worker",
        type=int,
        default=None,
        help="disaggregated: KV handoffs in flight per prefill worker (default 8)",
    )
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest Generate request taken, in bytes (default 32 MiB, at most 64 MiB)",
    )
    p.add_argument(
        "--grace-s", type=float, default=None, help="drain time for open streams on SIGTERM (30)"
    )
    p.add_argument(
        "--kvstore", dest="kvstore_address", default=None, help="the kvstore's HOST:PORT"
    )
    p.add_argument(
        "--kvstore-events",
        dest="kvstore_events_endpoint",
        default=None,
        help="the kvstore's KV-event endpoint (with --kvstore: routing sees what it holds)",
    )
    add_api_key_flag(p)
    p.add_argument(
        "--internal-host", help="address of the Registry and reply endpoint (default 127.0.0.1)"
    )
    p.add_argument(
        "--internal-port", type=int, help="the Registry's own port (default: the public one)"
    )
    p.add_argument(
        "--advertise-host",
        help="the host peers reach this process at, when it binds a wildcard (a pod's IP)",
    )
    p.add_argument(
        "--epp-port",
        type=int,
        help="serve the Envoy ext_proc v3 endpoint picker on this port of --host (default: off)",
    )
    p.add_argument(
        "--epp-target-port",
        type=int,
        help="the port the endpoint picker names on a worker's host: its HTTP gateway (8000)",
    )
    p.add_argument("--tls-dir", help=TLS_DIR_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


SERVICE = ServiceMain(
    package="llmfleet.services.router",
    description="The llmfleet router (public Generation API, routing, orchestration).",
    add_flags=add_flags,
    configs=(RouterConfig, AuthConfig),
    metrics_port_help="Prometheus /metrics port",
)
main = SERVICE.main
build_parser = SERVICE.build_parser  # argparse parser; for tests and `llmfleet <service>`

if __name__ == "__main__":
    sys.exit(main())
