"""The Responses API's store: responses kept in memory for GET and `previous_response_id`.

Bounded three ways: at most `max_entries` responses, at most `max_bytes` of them (the size of
each entry's JSON), each for `ttl_s` after it was stored. Entries leave oldest first: expired
ones on every access, then the oldest while a new entry would pass a bound; an entry larger
than `max_bytes` alone is not stored. With one TTL for all, insertion order is expiry order,
so an ordered dict is the whole index (every operation O(1) amortized). Not thread-safe: the
gateway uses it from its event loop only.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmfleet.shared.core.errors import ValidationError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    # The conversation it ends, as chat messages: its input (previous turns included, its
    # `instructions` not) then its output; the prefix of a request that continues it.
    conversation: list[dict[str, Any]]
    num_bytes: int
    expires_at: float


class ResponseStore:
    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0:
            raise ValidationError("responses_store_max_entries", "must be >= 0")
        if max_bytes < 0:
            raise ValidationError("responses_store_max_bytes", "must be >= 0")
        if ttl_s <= 0:
            raise ValidationError("responses_store_ttl_s", "must be > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(
        self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> bool:
        """Store a response (replacing one of the same id); False when it cannot fit at all."""
        self.delete(response_id)
        size = len(json.dumps([response, conversation], separators=(",", ":")).encode())
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._expire()
        while self._entries and (
            len(self._entries) >= self.max_entries or self.num_bytes + size > self.max_bytes
        ):
            self._pop_oldest()
        expires = self._clock() + self.ttl_s
        self._entries[response_id] = StoredResponse(response, conversation, size, expires)
        self.num_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.num_bytes
