"""`llmfleet up`: start a fleet on this machine from the command line's arguments, print its
endpoint (and the gateway's URL) on stdout once every child is SERVING, then one line per child
`llmfleet: metrics of NAME on URL` (its Prometheus endpoint; on stderr with `--chat`), then run
until SIGINT/SIGTERM or the end of `--chat`, starting again any child that exits (launcher.py,
supervisor.py; with `--no-restart` a child exiting stops the fleet instead); the fleet is drained
and stopped on every way out. Exit status: 0 after a requested stop (or the chat's own status), 1
when the fleet did not start or (`--no-restart`) a child exited; bad arguments raise
`ValidationError` (status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable
from typing import IO

from llmfleet.cli.fleet_plan import FleetSpec, FleetStartError
from llmfleet.cli.generate import ENGINE_FLAGS, remote_chat
from llmfleet.cli.launcher import Fleet, write_line
from llmfleet.services.tokenizer.flags import media_argv
from llmfleet.shared.core.config import ENV_PREFIX, AuthConfig, EngineConfig, from_env
from llmfleet.shared.core.engine_flags import NESTED, TP_GROUP_FLAGS
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative_settings import SpeculativeSettings

# The engine settings `up` forwards to its workers as they are (ENGINE_FLAGS choose the model;
# the speculative flags go to decode and unified workers only).
ENGINE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name not in (*ENGINE_FLAGS, *NESTED, *TP_GROUP_FLAGS)
)
SPECULATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeSettings))


def cmd_up(args: argparse.Namespace) -> int:
    if args.disaggregated and args.workers is not None:
        raise ValidationError("--workers", "use --prefill-workers/--decode-workers with it")
    if not args.disaggregated and (args.prefill_workers or args.decode_workers):
        raise ValidationError("--prefill-workers", "applies with --disaggregated only")
    auth = from_env(AuthConfig, api_keys=args.api_keys)  # --api-key over $LLMFLEET_API_KEYS
    # The router and gateway read their keys from the environment, not from argv (`ps`).
    env = {f"{ENV_PREFIX}API_KEYS": ",".join(auth.api_keys)} if args.api_keys else {}
    spec = FleetSpec(
        host=args.host,
        port=args.port,
        internal_host=args.internal_host,
        tls_dir=args.tls_dir,
        disaggregated=args.disaggregated,
        workers=args.workers if args.workers is not None else 1,
        prefill_workers=args.prefill_workers if args.prefill_workers is not None else 1,
        decode_workers=args.decode_workers if args.decode_workers is not None else 1,
        model=args.model,
        device=args.device,
        worker_devices=tuple(args.worker_devices or ()),
        dtype=args.dtype,
        quantization=args.quantization,
        engine={f: getattr(args, f) for f in ENGINE_FIELDS if getattr(args, f) is not None},
        speculative=SpeculativeSettings(**{f: getattr(args, f) for f in SPECULATIVE_FIELDS}),
        routing_policy=args.routing_policy,
        kvstore=not args.no_kvstore,
        gateway=not args.no_gateway,
        http_port=args.http_port,
        log_dir=args.log_dir,
        echo=not args.quiet,
        startup_timeout_s=args.startup_timeout,
        env=env,
        grace_s=args.grace_s,
        supervise=not args.no_restart,
        metrics_port=args.metrics_port,
        metrics_port_base=args.metrics_port_base,
        extra_args={"tokenizer": media_argv(args)},
    )
    session = None
    if args.chat:

        def session(endpoint: str) -> int:
            # The engine flags chose the fleet's model; the chat itself is a plain client.
            chat_args = argparse.Namespace(
                **{**vars(args), "endpoint": endpoint, "api_key": auth.keyring.any_secret()}
            )
            for flag in ENGINE_FLAGS:
                setattr(chat_args, flag, None)
            return remote_chat(chat_args)

    return run(spec, session=session)


def run(
    spec: FleetSpec,
    *,
    out: IO[str] | None = None,
    session: Callable[[str], int] | None = None,
) -> int:
    """`llmfleet up`: start, print the endpoint, run until SIGINT/SIGTERM (or, unsupervised,
    a child dies).

    With `session` (e.g. an interactive chat), call it with the endpoint once the fleet serves
    and stop the fleet when it returns; its return value is the exit status.
    Returns the exit status: 0 after a requested stop, 1 when the fleet failed to start or a
    child exited on its own.
    """
    out = out or sys.stdout
    stop = threading.Event()
    fleet = Fleet(spec)
    in_session = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        fleet.interrupt()
        if in_session.is_set():
            raise KeyboardInterrupt  # a blocking read in the session would otherwise resume

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            fleet.start()
        except FleetStartError as exc:
            if stop.is_set():
                return 0
            write_line(sys.stderr, f"llmfleet: the fleet did not start: {exc}")
            return 1
        print(f"llmfleet: serving on {fleet.endpoint}", file=out, flush=True)
        if fleet.http_url is not None:
            print(f"llmfleet: OpenAI-compatible API on {fleet.http_url}/v1", file=out, flush=True)
        # A chat owns stdout: the metrics lines go to stderr then.
        listing = out if session is None else sys.stderr
        for name, url in fleet.metrics_urls.items():
            print(f"llmfleet: metrics of {name} on {url}", file=listing, flush=True)
        if fleet.metrics_url is not None:
            write_line(sys.stderr, f"llmfleet: child restarts on {fleet.metrics_url}")
        if session is not None:
            in_session.set()
            try:
                return session(fleet.endpoint)
            except KeyboardInterrupt:
                return 0
            finally:
                in_session.clear()
        write_line(sys.stderr, f"llmfleet: logs in {fleet.log_dir}; Ctrl-C stops the fleet")
        while not stop.wait(0.2):
            dead = fleet.poll() if fleet.supervisor is None else None
            if dead is not None:
                write_line(
                    sys.stderr,
                    f"llmfleet: {dead.name} exited with status {dead.proc.returncode} "  # type: ignore[union-attr]
                    f"(log: {dead.log_path}); stopping the fleet. Its last output:\n"
                    f"{dead.output_tail()}",
                )
                return 1
        write_line(sys.stderr, f"llmfleet: draining (grace {spec.grace_s:g} s) and stopping")
        return 0
    finally:
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
