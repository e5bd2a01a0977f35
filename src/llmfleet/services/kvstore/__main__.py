"""`python -m llmfleet.services.kvstore [flags]`: run a kvstore until SIGTERM/SIGINT (exit 0).

Flags override `LLMFLEET_KVSTORE_*` environment variables (see shared/core/config.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import zmq

from llmfleet.services.kvstore.server import serve
from llmfleet.shared.core.config import KVStoreConfig, from_env
from llmfleet.shared.core.errors import LLMFleetError, ValidationError


def parse_config(argv: Sequence[str] | None = None) -> KVStoreConfig:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.services.kvstore",
        description="llmfleet kvstore: content-addressed KV blocks in RAM and on disk",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: any)")
    p.add_argument("--data-port", type=int, help="ZMQ ROUTER port for put/get (0: any)")
    p.add_argument("--events-port", type=int, help="ZMQ PUB port for KV events (0: any)")
    p.add_argument("--ram-bytes", type=lambda s: int(s, 0), help="RAM tier budget in bytes")
    p.add_argument("--disk-dir", help="disk tier directory (default: no disk tier)")
    p.add_argument("--disk-bytes", type=lambda s: int(s, 0), help="disk tier budget in bytes")
    args = p.parse_args(argv)
    try:
        return from_env(KVStoreConfig, **vars(args))
    except ValidationError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


async def _run(config: KVStoreConfig) -> None:
    server = await serve(config, install_signal_handlers=True)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = parse_config(argv)
    try:
        asyncio.run(_run(config))
    except (LLMFleetError, OSError, zmq.ZMQError) as e:
        logging.getLogger("llmfleet.services.kvstore").error("kvstore failed to start: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
