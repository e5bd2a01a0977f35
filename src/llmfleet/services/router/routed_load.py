"""What this router has sent each worker that its load reports may not show yet.

    routed = RoutedLoad()
    routed.sent(worker_id, 1)                      # a leg (or decode lease) placed there
    with routed.in_prefill(worker_id, tokens):     # a disaggregated prefill, slot wait included
        with routed.in_transfer(decode_id, n):     # its KV on the way to the decode worker
            ...
    candidate = routed.candidate(worker_id, load, prefix_blocks=..., store_blocks=...)

Pure bookkeeping: requests not ended per worker; of those, the ones without a first token yet
with the prompt tokens they compute; and the KV tokens on their way to a worker, one transfer
after another: the kvstore fetches of those prompts, and on a decode worker the KV leased
there and not yet pushed. `candidate` turns it, with the worker's
last load report, into what the routing policies see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmfleet.services.router.registry import Load
from llmfleet.services.router.routing import Candidate


class RoutedLoad:
    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # worker id -> requests not ended
        self.prefilling: dict[str, tuple[int, int]] = {}  # worker id -> (tokens, requests)
        self.incoming: dict[str, int] = {}  # worker id -> KV tokens on their way there

    def sent(self, worker_id: str, requests: int) -> None:
        """`requests` (1 or -1) more not ended on `worker_id`."""
        _add(self.requests, worker_id, requests)

    def prefill(self, worker_id: str, tokens: int, requests: int, fetched: int = 0) -> None:
        """`requests` (1 or -1) with `tokens` prompt tokens to compute enter or leave
        `worker_id`'s queue, and with `fetched` more to fetch from the kvstore there."""
        self.transfer(worker_id, fetched)
        had_tokens, had_requests = self.prefilling.get(worker_id, (0, 0))
        left = (had_tokens + tokens, had_requests + requests)
        if left[1] > 0:
            self.prefilling[worker_id] = left
        else:
            self.prefilling.pop(worker_id, None)

    def transfer(self, worker_id: str, tokens: int) -> None:
        """`tokens` more (or fewer) of KV on their way to `worker_id`."""
        _add(self.incoming, worker_id, tokens)

    @contextlib.contextmanager
    def in_prefill(self, worker_id: str, tokens: int, fetched: int = 0) -> Iterator[None]:
        """A prompt of `tokens` (and `fetched`) in `worker_id`'s queue while the block runs (a
        disaggregated prefill: no leg, one RPC)."""
        self.prefill(worker_id, tokens, 1, fetched)
        try:
            yield
        finally:
            self.prefill(worker_id, -tokens, -1, -fetched)

    @contextlib.contextmanager
    def in_transfer(self, worker_id: str, tokens: int) -> Iterator[None]:
        """`tokens` of KV leased on `worker_id` and pushed there while the block runs."""
        self.transfer(worker_id, tokens)
        try:
            yield
        finally:
            self.transfer(worker_id, -tokens)

    def candidate(
        self,
        worker_id: str,
        load: Load,
        *,
        prefix_blocks: int,
        store_blocks: int,
        affinity: bool = False,
    ) -> Candidate:
        """A worker as the routing policies see it: its last load report, raised to what this
        router has sent it since when that is more, and the request's cached prefix there and
        in the kvstore."""
        tokens, prefilling = self.prefilling.get(worker_id, (0, 0))
        return Candidate(
            worker_id,
            max(load.num_requests, self.requests.get(worker_id, 0), prefilling),
            load.num_free_blocks,
            prefix_blocks,
            num_total_blocks=load.num_total_blocks,
            store_blocks=store_blocks,
            queued_prompt_tokens=max(load.num_queued_prompt_tokens, tokens),
            # what the worker measured; 0 until it has (the scorers fill in: routing.py)
            step_s=load.step_seconds,
            step_s_per_seq=load.step_seconds_per_seq,
            step_token_budget=load.max_num_batched_tokens,
            prefill_s_per_token=load.prefill_seconds_per_token,
            fetch_s_per_token=load.fetch_seconds_per_token,
            num_queued=max(load.num_waiting, prefilling),
            incoming_kv_tokens=self.incoming.get(worker_id, 0),
            affinity=affinity,
        )


def _add(counts: dict[str, int], worker_id: str, n: int) -> None:
    left = counts.get(worker_id, 0) + n
    if left > 0:
        counts[worker_id] = left
    else:
        counts.pop(worker_id, None)
