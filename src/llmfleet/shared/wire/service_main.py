"""The `main` of every service (`python -m llmfleet.services.<name>`): the command line, logging
to stderr, the service's configs from its flags over `LLMFLEET_*` variables, its `serve` run
until a SIGTERM/SIGINT drain, and the exit status. A service's `__main__` is its own flags and
a `ServiceMain` describing it.

Every service takes `--host`, `--port` and `--metrics-port` first, then its own flags. A flag
reaches the configs by name: its `dest` is a field of exactly one of the service's config
classes (`from_env(cls, **flags)`; a flag not given is None and leaves the variable or the
default in place), or one of its `serve_flags` (passed to `serve` as keywords), or `verbose`
(`-v`: debug logging). Nothing is printed to stdout.

Exit status: 0 after a SIGTERM/SIGINT drain; 1 when the service cannot start (or fails with an
`LLMFleetError`, `OSError` or `zmq.ZMQError`); 2 on a bad flag (argparse's usage and message)
or a bad configuration value, printed as `error: invalid <field>: <message>` or, for a service
declared with `usage_on_bad_config`, as argparse's usage and `<prog>: error: <field>: <message>`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from llmfleet.shared.core.config import from_env
from llmfleet.shared.core.errors import LLMFleetError, ValidationError


@dataclass(frozen=True)
class ServiceMain:
    """How the service in `package` starts from its command line (`python -m <package>`).

    Its `serve` is `<package>.server.serve`, imported by name only once the configs are valid
    (a bad flag fails fast, without loading the service). It is called as
    `serve(*configs, **serve_flags)` and runs until drained; with `returns_server` it is called
    with `install_signal_handlers=True` too and returns the started server, whose
    `wait_for_termination()` runs it until SIGTERM/SIGINT and drains.
    """

    package: str  # e.g. "llmfleet.services.router"; its last part names the service in logs
    description: str
    add_flags: Callable[[argparse.ArgumentParser], None]  # the flags after the three common ones
    configs: tuple[type, ...]  # the config classes of its flags (`serve` takes them, folded)
    port_help: str = "gRPC port (0: any free port)"
    metrics_port_help: str = "Prometheus /metrics port (0: any)"
    serve_flags: tuple[str, ...] = ()  # flags passed to `serve` as keywords, in this order
    # The configs `serve` takes, from the parsed ones (e.g. the worker folds its speculative
    # settings into its EngineConfig); may raise ValidationError. None: as parsed.
    fold: Callable[..., tuple[Any, ...]] | None = None
    returns_server: bool = False
    usage_on_bad_config: bool = False

    @property
    def name(self) -> str:
        return self.package.rpartition(".")[2]

    def build_parser(self, prog: str | None = None) -> argparse.ArgumentParser:
        """The service's command line; `prog` names it in usage (default `python -m <package>`,
        `llmfleet <name>` when run from the `llmfleet` command)."""
        p = argparse.ArgumentParser(
            prog=prog or f"python -m {self.package}", description=self.description
        )
        p.add_argument("--host", help="bind address (default 127.0.0.1)")
        p.add_argument("--port", type=int, help=self.port_help)
        p.add_argument("--metrics-port", type=int, help=self.metrics_port_help)
        self.add_flags(p)
        return p

    def parse(self, argv: Sequence[str] | None = None, prog: str | None = None) -> tuple[Any, ...]:
        """The configs, then the values of `serve_flags`, from `argv` over the environment.

        A bad flag exits with status 2 (argparse, its usage naming `prog`); so does a bad
        configuration value with `usage_on_bad_config`, which otherwise raises
        `ValidationError`."""
        parser = self.build_parser(prog)
        flags = vars(parser.parse_args(argv))
        flags.pop("verbose", None)
        return self._configs(parser, flags)

    def main(self, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
        """Run the service; returns the exit status (a bad flag exits with 2 from argparse; a
        service that failed leaves the process at once with 1)."""
        parser = self.build_parser(prog)
        flags = vars(parser.parse_args(argv))
        logging.basicConfig(
            level=logging.DEBUG if flags.pop("verbose", False) else logging.INFO,
            stream=sys.stderr,
            format=f"%(asctime)s %(levelname)s {self.name} %(name)s: %(message)s",
        )
        try:
            parsed = self._configs(parser, flags)
        except ValidationError as exc:
            print(f"error: invalid {exc.field}: {exc.message}", file=sys.stderr)
            return 2
        serve = importlib.import_module(f"{self.package}.server").serve
        try:
            asyncio.run(self._run(serve, parsed))
        except (LLMFleetError, OSError, zmq.ZMQError) as exc:
            logger = logging.getLogger(self.package)
            logger.error("%s failed: %s", self.name, exc)
            # Leave now with status 1: a thread the failure left blocked (an engine thread in
            # a failed step, a socket's linger) must not hold up the exit a supervisor waits on.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
        return 0

    def _configs(self, parser: argparse.ArgumentParser, flags: dict[str, Any]) -> tuple[Any, ...]:
        per_config: list[dict[str, Any]] = [{} for _ in self.configs]
        fields = [{f.name for f in dataclasses.fields(cls)} for cls in self.configs]
        for dest, value in flags.items():
            if dest in self.serve_flags:
                continue
            owners = [i for i, names in enumerate(fields) if dest in names]
            if len(owners) != 1:
                raise TypeError(f"{self.name}: flag {dest} must be a field of exactly one config")
            per_config[owners[0]][dest] = value
        try:
            configs = [from_env(c, **kw) for c, kw in zip(self.configs, per_config, strict=True)]
            if self.fold is not None:
                configs = list(self.fold(*configs))
        except ValidationError as exc:
            if self.usage_on_bad_config:
                parser.error(str(exc))
            raise
        return (*configs, *(flags[name] for name in self.serve_flags))

    async def _run(self, serve: Callable[..., Any], parsed: tuple[Any, ...]) -> None:
        split = len(parsed) - len(self.serve_flags)
        configs, values = parsed[:split], parsed[split:]
        kwargs = dict(zip(self.serve_flags, values, strict=True))
        if not self.returns_server:
            await serve(*configs, **kwargs)
            return
        server = await serve(*configs, install_signal_handlers=True, **kwargs)
        await server.wait_for_termination()
