"""Triton's file cache with a read-only seed: native modules built ahead of time, for a container
image without a C compiler.

Triton compiles its CUDA driver module (`driver.c`) with the system C compiler the first time a
process launches a kernel and keeps the result in its cache (`$TRITON_CACHE_DIR`, default
`~/.triton/cache`, one directory per content hash). The CUDA image (deploy/docker/Dockerfile.cuda)
compiles it in a build stage and ships that cache as a seed; selected with

    TRITON_CACHE_MANAGER=llmfleet.kernels.triton_cache:SeededCacheManager
    LLMFLEET_TRITON_SEED_DIR=/opt/triton-seed

a lookup that misses the cache finds the seed's file, while everything compiled at run time
(the kernels) goes to the cache, which can live on a writable volume under a read-only root.
The seed is never written.
"""

from __future__ import annotations

import os
from pathlib import Path

from triton.runtime.cache import FileCacheManager

SEED_DIR_ENV = "LLMFLEET_TRITON_SEED_DIR"


class SeededCacheManager(FileCacheManager):
    """Triton's `FileCacheManager` whose `get_file` misses fall back on
    `$LLMFLEET_TRITON_SEED_DIR/<key>/<file>` (same layout as the cache). Kernel dumps and
    overrides (`dump`, `override`) are Triton's own."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override=override, dump=dump)
        seed = os.environ.get(SEED_DIR_ENV)
        self._seed = Path(seed) / key if seed and not (override or dump) else None

    def get_file(self, filename: str) -> str | None:
        found = super().get_file(filename)
        if found is None and self._seed is not None and (self._seed / filename).is_file():
            return str(self._seed / filename)
        return found
