"""`python -m llmfleet.shared.wire.health_probe HOST:PORT [--service NAME] [--tls-dir DIR]`:
one `grpc.health.v1.Health/Check`; exit 0 when the service answers SERVING, 1 otherwise
(NOT_SERVING, a service it does not know, no answer within `--timeout-s`), 2 on a bad flag.

The exec probe of a Kubernetes pod whose gRPC port takes only mutual TLS (`--tls-dir`): the
kubelet's own gRPC probe speaks plaintext and cannot present the fleet's client certificate
(deploy/kubernetes/components/mtls). It prints one line to stderr when the check fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire import tls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmfleet.shared.wire.health_probe",
        description="Exit 0 when the gRPC service at ADDRESS answers SERVING to a health check.",
    )
    p.add_argument("address", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="the health service name ('': the server)")
    p.add_argument("--tls-dir", help=tls.TLS_DIR_HELP)
    p.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the check (3)")
    return p


def check(address: str, service: str, tls_dir: str | None, timeout_s: float) -> str | None:
    """None when `service` at `address` is SERVING, else why not."""
    try:
        creds = tls.load(tls_dir)
    except ValidationError as exc:
        return str(exc)
    with tls.channel(address, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    failure = check(args.address, args.service, args.tls_dir, args.timeout_s)
    if failure is not None:
        print(f"{args.address} {args.service or '(server)'}: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
