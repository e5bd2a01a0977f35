"""`llmfleet <service> ARGS...`: one entry point per service, the same as
`python -m llmfleet.services.<service> ARGS...` (the container images' commands).

Each runs the service's own `main` from its `__main__` module with the remaining arguments
untouched, so its flags, help, logging and exit status are the service's: 0 after a
SIGTERM/SIGINT drain, 1 when it cannot start, 2 on a bad flag. Only the program name in usage
differs (`llmfleet router` rather than `python -m llmfleet.services.router`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType

SERVICES: dict[str, str] = {
    "router": "the router: the public Generation API, worker registry and routing",
    "worker": "a worker: one engine serving a role (unified, prefill, decode)",
    "tokenizer": "the tokenizer service",
    "kvstore": "the shared KV store",
    "gateway": "the OpenAI-compatible HTTP gateway",
}


def _entry(name: str) -> ModuleType:
    if name not in SERVICES:
        raise ValueError(f"no service {name!r}; one of {', '.join(SERVICES)}")
    return importlib.import_module(f"llmfleet.services.{name}.__main__")


def service_parser(name: str) -> argparse.ArgumentParser:
    """The argparse parser of service `name`, as `llmfleet <name>` parses its arguments."""
    return _entry(name).build_parser(prog=f"llmfleet {name}")


def run_service(name: str, argv: Sequence[str]) -> int:
    """Run service `name` with `argv` until it drains; returns its exit status."""
    return _entry(name).main(list(argv), prog=f"llmfleet {name}")
