"""The encoder-output cache: a vision encoder's rows per image, keyed by content hash.

    cache = EncoderCache(max_bytes=256 << 20)
    cache.pin("req-1", hashes)          # at admission: these stay while req-1 may need them
    rows = cache.get(h)                 # (num_placeholder_tokens, hidden) on the model's device
    cache.put(h, rows)                  # after the encoder ran; evicts unpinned LRU entries
    cache.unpin("req-1")                # the request ended

Bounded in bytes over the unpinned entries: a put evicts least recently used entries that no
request pins until the total fits `max_bytes`. Pinned entries are never evicted (a request
admitted with an image it did not bring pixels for relies on the entry), so while pins hold
more than the bound the cache exceeds it; it shrinks back as the requests end.

Owned by the engine thread; `__contains__` may be read from another thread (the worker's
asyncio side, to decide which pixels to fetch): a stale answer only costs a refetch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU first
        self._pins: dict[str, int] = {}  # content hash -> number of requests pinning it
        self._owners: dict[str, list[str]] = {}  # request id -> the hashes it pinned
        self.num_bytes = 0
        self.num_evicted = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, content_hash: str) -> torch.Tensor | None:
        rows = self._rows.get(content_hash)
        if rows is not None:
            self._rows.move_to_end(content_hash)
        return rows

    def put(self, content_hash: str, rows: torch.Tensor) -> None:
        old = self._rows.pop(content_hash, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        self._rows[content_hash] = rows
        self.num_bytes += rows.nbytes
        self._evict()

    def pin(self, owner: str, hashes: Iterable[str]) -> None:
        """Keep `hashes` (present now or put later) until `unpin(owner)`; an owner's pins are
        one set: pinning again replaces it."""
        kept = list(dict.fromkeys(hashes))
        for h in kept:  # (before dropping the old set, so a hash in both is never evicted)
            self._pins[h] = self._pins.get(h, 0) + 1
        self.unpin(owner)
        self._owners[owner] = kept

    def unpin(self, owner: str) -> None:
        """Drop `owner`'s pins (nothing when it has none); evicts what the bound requires."""
        for h in self._owners.pop(owner, ()):
            n = self._pins[h] - 1
            if n:
                self._pins[h] = n
            else:
                del self._pins[h]
        self._evict()

    def is_pinned(self, content_hash: str) -> bool:
        return content_hash in self._pins

    def _evict(self) -> None:
        if self.num_bytes <= self.max_bytes:
            return
        for h in [h for h in self._rows if h not in self._pins]:  # LRU first
            self.num_bytes -= self._rows.pop(h).nbytes
            self.num_evicted += 1
            if self.num_bytes <= self.max_bytes:
                return
