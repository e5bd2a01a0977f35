"""Which machine and GPU this process runs on, as processes that share GPU memory must agree
on them."""

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


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`: one GPU's name in every process."""
    import torch  # the layers under the wire import no torch at module level

    return str(torch.cuda.get_device_properties(index).uuid)
