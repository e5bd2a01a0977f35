"""`python -m llmfleet.services.worker [flags]`: run a worker until SIGTERM/SIGINT (exit 0).

Flags override `LLMFLEET_WORKER_*` (service) and `LLMFLEET_*` (engine) environment variables
(see shared/core/config.py). On SIGTERM the worker turns NOT_SERVING, deregisters, lets in-flight
requests finish within the grace period (aborting the rest) and exits 0. Exit status: 1 when the
worker cannot start or its forward pass failed (its requests handed back to the router), 2 on a
bad flag or configuration value (with usage).

With `--tp-join HOST:PORT --tp-rank R` the process is no worker but rank R of the tensor-parallel
group of the worker at HOST:PORT (its `--tp-port`) on another machine: it loads its shard and
runs the leader's steps, serves nothing and never registers; it exits 0 when the leader closes
the group, 1 when the leader cannot be reached or goes away.
"""

from __future__ import annotations

import argparse
import sys

from llmfleet.shared.core.config import WORKER_ROLES, EngineConfig, WorkerConfig
from llmfleet.shared.core.engine_flags import add_engine_flags
from llmfleet.shared.core.speculative_settings import SpeculativeSettings
from llmfleet.shared.wire.service_main import ServiceMain
from llmfleet.shared.wire.tls import TLS_DIR_HELP


def add_flags(p: argparse.ArgumentParser) -> None:
    """WorkerConfig's flags, --grace-s, then EngineConfig's (SpeculativeSettings' among them)."""
    p.add_argument("--role", choices=WORKER_ROLES, help="default unified")
    p.add_argument("--worker-id", help="unique id (default: derived from address and pid)")
    p.add_argument("--router", dest="router_address", help="Registry HOST:PORT")
    p.add_argument(
        "--advertise-host",
        help="the host peers reach this process at, when it binds a wildcard (a pod's IP)",
    )
    p.add_argument("--kvstore", dest="kvstore_address", help="kvstore gRPC HOST:PORT")
    p.add_argument("--kvstore-endpoint", help="kvstore ZMQ data endpoint tcp://HOST:PORT")
    p.add_argument(
        "--kvstore-events",
        dest="kvstore_events_endpoint",
        help="kvstore KV-event endpoint tcp://HOST:PORT (skips lookups it has nothing for)",
    )
    p.add_argument(
        "--kvstore-put-delay-ms",
        type=int,
        help="start prompt-block puts this long after the first token (default 20)",
    )
    p.add_argument(
        "--kvstore-put-max-bytes",
        type=lambda s: int(s, 0),
        help="KV bytes of puts in flight at most; a put over it is dropped (default 1 GiB)",
    )
    p.add_argument(
        "--first-token-yield-ms",
        type=float,
        help="CPU: wait this long after a request's first token before the next step (default 4)",
    )
    p.add_argument("--lease-ttl-ms", type=int, help="default lifetime of KV leases granted here")
    p.add_argument("--kv-push-timeout-ms", type=int, help="prefill: wait this long for acks")
    p.add_argument(
        "--kv-transfer",
        choices=("auto", "host"),
        help="prefill on CUDA: auto (default) moves KV to a decode worker on this host GPU to "
        "GPU (CUDA IPC), host staging where refused; host: always through host memory",
    )
    p.add_argument("--grace-s", type=float, default=30.0, help="drain period on SIGTERM")
    p.add_argument("--tls-dir", help=TLS_DIR_HELP)
    p.add_argument(
        "--fault-inject-step",
        type=int,
        help="tests only: fail every engine step from step N on, as a failing forward pass",
    )
    add_engine_flags(p)


def _fold(
    worker: WorkerConfig, engine: EngineConfig, speculative: SpeculativeSettings
) -> tuple[WorkerConfig, EngineConfig]:
    from llmfleet.services.worker.speculation import fold_speculation  # (imports torch)

    return fold_speculation(worker, engine, speculative)


SERVICE = ServiceMain(
    package="llmfleet.services.worker",
    description="llmfleet worker: one engine core serving a role (unified, prefill, decode)",
    add_flags=add_flags,
    configs=(WorkerConfig, EngineConfig, SpeculativeSettings),
    fold=_fold,
    serve_flags=("grace_s",),
    returns_server=True,
    usage_on_bad_config=True,
)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the worker (`SERVICE.main`), or with --tp-join one rank of another worker's group,
    whose end exits the process (`tp_follower.exit_rank`)."""
    _, engine, _ = SERVICE.parse(argv, prog)
    if engine.tp_join is None:
        return SERVICE.main(argv, prog)
    from llmfleet.engine.tp_follower import exit_rank, join_leader  # (imports torch)

    exit_rank(join_leader(engine))


build_parser = SERVICE.build_parser  # argparse parser; for tests and `llmfleet <service>`
parse_config = SERVICE.parse  # (WorkerConfig, EngineConfig, grace_s), for tests

if __name__ == "__main__":
    sys.exit(main())
