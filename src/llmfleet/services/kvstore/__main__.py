"""`python -m llmfleet.services.kvstore [flags]`: run a kvstore until SIGTERM/SIGINT (exit 0).

Flags override `LLMFLEET_KVSTORE_*` environment variables (see shared/core/config.py). Exit
status: 1 when the kvstore cannot start, 2 on a bad flag or configuration value (with usage).
"""

from __future__ import annotations

import argparse
import sys

from llmfleet.shared.core.config import KVStoreConfig
from llmfleet.shared.wire.service_main import ServiceMain
from llmfleet.shared.wire.tls import TLS_DIR_HELP


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-port", type=int, help="ZMQ ROUTER port for put/get (0: any)")
    p.add_argument("--events-port", type=int, help="ZMQ PUB port for KV events (0: any)")
    p.add_argument("--ram-bytes", type=lambda s: int(s, 0), help="RAM tier budget in bytes")
    p.add_argument("--disk-dir", help="disk tier directory (default: no disk tier)")
    p.add_argument("--disk-bytes", type=lambda s: int(s, 0), help="disk tier budget in bytes")
    p.add_argument("--tls-dir", help=TLS_DIR_HELP)


SERVICE = ServiceMain(
    package="llmfleet.services.kvstore",
    description="llmfleet kvstore: content-addressed KV blocks in RAM and on disk",
    add_flags=add_flags,
    configs=(KVStoreConfig,),
    returns_server=True,
    usage_on_bad_config=True,
)
main = SERVICE.main
build_parser = SERVICE.build_parser  # argparse parser; for tests and `llmfleet <service>`

if __name__ == "__main__":
    sys.exit(main())
