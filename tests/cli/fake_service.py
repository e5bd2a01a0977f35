"""A stand-in for any llmfleet service, for launcher tests: `python -m fake_service [flags]`.

It accepts every service's flags, serves only gRPC health (through the real `Service` shell:
NOT_SERVING, then SERVING, drain on SIGTERM) and records what happened as JSON lines in the
file named by $FAKEFLEET_LOG. Its name is its `--worker-id`, else the kind its flags imply
(`--mode`: router, `--data-port`: kvstore, otherwise tokenizer).
$FAKEFLEET_FAIL=<name>: that child prints a message and exits with status 3 at once.
$FAKEFLEET_HANG=<name>: that child never reports SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from llmfleet.shared.wire.service import Service


def _record(event: str, name: str) -> None:
    path = os.environ.get("FAKEFLEET_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "name": name, "argv": sys.argv[1:]}) + "\n")


async def _serve(name: str, host: str, port: int, metrics_port: int) -> None:
    svc = Service(name, host, port, metrics_port=metrics_port, grace_s=1.0)
    svc.install_signal_handlers()
    await svc.start([])
    if os.environ.get("FAKEFLEET_HANG") != name:
        await svc.set_serving()
    await svc.wait_for_termination()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--worker-id")
    p.add_argument("--mode")
    p.add_argument("--data-port")
    args, _ = p.parse_known_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    name = args.worker_id or (
        "router" if args.mode else "kvstore" if args.data_port else "tokenizer"
    )
    if os.environ.get("FAKEFLEET_FAIL") == name:
        print(f"fake failure in {name}: cannot load anything", file=sys.stderr)
        return 3
    _record("start", name)
    asyncio.run(_serve(name, args.host, args.port, args.metrics_port))
    _record("stop", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
