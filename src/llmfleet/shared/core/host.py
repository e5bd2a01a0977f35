"""Which machine this process runs on, as processes that share GPU memory must agree on it."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def host_id() -> str:
    """This host's identity: the kernel's boot id, the same in every process and container of
    one boot of one machine ("" where the kernel does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
