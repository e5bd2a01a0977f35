"""The `main` of a service whose `serve(config)` coroutine runs until it is drained (the
tokenizer, the router, the gateway): logging to stderr, the config from flags over
`LLMFLEET_<SECTION>_*` variables, and the exit status.

Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the service cannot start, 2 on a bad flag
or configuration value (printed as `error: invalid <field>: <message>`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from llmfleet.shared.core.config import from_env
from llmfleet.shared.core.errors import LLMFleetError, ValidationError

C = TypeVar("C")


def run_service(
    name: str,
    config_class: type[C],
    flags: dict[str, Any],
    load_serve: Callable[[], Callable[[C], Awaitable[Any]]],
    *,
    verbose: bool = False,
) -> int:
    """Run service `name`; `flags` are the parsed flags (None: not given), `load_serve`
    imports the service's `serve` once the config is valid (bad flags fail fast)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
    )
    try:
        config = from_env(config_class, **flags)
    except ValidationError as exc:
        print(f"error: invalid {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    serve = load_serve()
    try:
        asyncio.run(serve(config))  # type: ignore[arg-type]
    except (LLMFleetError, OSError) as exc:
        logging.getLogger(f"llmfleet.services.{name}").error("%s failed: %s", name, exc)
        return 1
    return 0
