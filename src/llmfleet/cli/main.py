"""The `llmfleet` command line.

    llmfleet up [--disaggregated] [--workers N] [--port 50051] [--http-port 8000] [--model PATH] ...
    llmfleet generate [--endpoint HOST:PORT] [--raw] [--max-tokens N] [--n N] [--stream] PROMPT
    llmfleet chat [--endpoint HOST:PORT] [--system TEXT]
    llmfleet generate --offline ... PROMPT       (the engine in this process, no fleet)
    llmfleet bench serve [--backend grpc|openai|openai-chat] [--dataset-name ...] ...
    llmfleet tls init DIR                         (a development CA and fleet credentials)
    llmfleet router|worker|tokenizer|kvstore|gateway ARGS...   (one service, as its __main__)

`generate` and `chat` talk gRPC to a fleet (`--endpoint`, else `LLMFLEET_ENDPOINT`, else
127.0.0.1:50051); `--offline` runs the engine in this process instead. Only completions go to
stdout; logs, logprobs and errors go to stderr. Exit status: 0 ok; 1 the fleet is unreachable
or failed; 2 bad input (the message names the parameter); 130 interrupted.

This module parses (`parser`), dispatches to `generate`, `up` or `bench serve`, and turns an
`LLMFleetError` into a message on stderr and the exit status. `llmfleet <service> ARGS...` goes
to the service's own `main` unparsed (`services`): its flags, logs and exit status are the
service's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llmfleet.cli.generate import offline_chat, offline_generate, remote_chat, remote_generate
from llmfleet.cli.parser import build_parser
from llmfleet.cli.services import SERVICES, run_service
from llmfleet.shared.core.errors import LLMFleetError, ValidationError


def _report(exc: Exception, args: argparse.Namespace) -> int:
    """Print `exc` for a user; returns the exit status."""
    from llmfleet.client.generation import ClientError

    if isinstance(exc, ClientError):
        if exc.is_invalid_argument:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2
        endpoint = getattr(args, "endpoint", None) or "the fleet"
        if exc.code_name == "UNAVAILABLE" and "failed to connect" in exc.message:
            print(
                f"error: cannot reach llmfleet at {endpoint} ({exc.message}); "
                "is a fleet running there? Start one with `llmfleet up`.",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc.code_name}: {exc.message}", file=sys.stderr)
        return 1
    if isinstance(exc, ValidationError):
        print(f"error: invalid {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    print(f"error: {exc}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SERVICES:
        return run_service(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command not in ("up", "tls") and args.endpoint is None:
        from llmfleet.client.generation import ClientConfig
        from llmfleet.shared.core.config import from_env

        args.endpoint = from_env(ClientConfig).endpoint
    if getattr(args, "api_key", "") is None:  # generate, chat, bench serve
        from llmfleet.client.generation import ClientConfig
        from llmfleet.shared.core.config import from_env

        args.api_key = from_env(ClientConfig).api_key
    try:
        if args.command == "up":
            from llmfleet.cli.up import cmd_up

            return cmd_up(args)
        if args.command == "tls":
            from llmfleet.cli.tls_init import cmd_tls

            return cmd_tls(args)
        if args.command == "bench":
            from llmfleet.cli.benchserve.runner import main as bench_serve

            return bench_serve(args)
        if args.offline:
            return offline_generate(args) if args.command == "generate" else offline_chat(args)
        return remote_generate(args) if args.command == "generate" else remote_chat(args)
    except LLMFleetError as exc:
        return _report(exc, args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
