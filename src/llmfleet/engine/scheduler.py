"""The engine scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step fills a token budget (`max_num_batched_tokens`):
  1. running requests first, in arrival order: each gets what it still needs to compute
     (1 token when decoding, the rest of its prompt chunk otherwise), capped by the budget;
     a decoding request with drafts (`spec_token_ids`, speculative decoding) also gets a slot
     and a budget token for each, the drafts trimmed to the budget left and dropped when the
     KV cache is short of blocks for them (never preempting another request for a draft);
     when the KV cache has no block for one, the most recently admitted running request is
     preempted (its blocks freed; it goes back to the front of the queue and later recomputes);
  2. then waiting requests, FIFO, while the budget, `max_num_seqs` and free blocks allow:
     each takes its prefix-cache hit and schedules a chunk of the rest (chunked prefill).
Nothing here touches tensors; the model runner turns a `SchedulerOutput` into a batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    # Draft tokens computed after the request's known ones (their positions follow its last
    # token); every one of them, and the last known token, has a logits row.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """This step brings the request to its last token, so its logits are sampled (never
        an embedding's: its hidden states are pooled instead). Read it before the step
        advances `num_computed_tokens`."""
        req = self.request
        known = self.num_new_tokens - len(self.spec_token_ids)
        last = req.num_computed_tokens + known == req.num_tokens
        return last and req.pooling is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def has_drafts(self) -> bool:
        return any(s.spec_token_ids for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted and still to compute (waiting and running requests); a
        waiting request's prefix cached when it arrived is not counted."""
        return sum(
            max(0, r.num_prompt_tokens - max(r.num_computed_tokens, r.num_cached_on_arrival))
            for queue in (self.waiting, self.running)
            for r in queue
        )

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        if req.num_computed_tokens == 0:
            cached = self.bm.num_cached_prefix(req.block_hashes) * self.bm.block_size
            req.num_cached_on_arrival = min(cached, req.num_prompt_tokens - 1)
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            drafts = req.spec_token_ids[: budget - n] if n == need else []
            if drafts and not self.bm.allocate_slots(
                req, req.num_computed_tokens + n + len(drafts)
            ):
                drafts = []
            while not self.bm.allocate_slots(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n + len(drafts), drafts))
                budget -= n + len(drafts)
                i += 1
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed = self.bm.get_computed_blocks(req)
            num_cached = len(computed) * self.bm.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.bm.allocate_slots(req, num_cached + n, computed):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def add_running(self, req: Request) -> None:
        """Admit a request whose KV is already in its blocks (a lease turned into a sequence).

        It joins `running` directly: its blocks are allocated and `num_computed_tokens` set by
        the caller, so there is nothing to admit. It may exceed `max_num_seqs` by the number of
        such requests; preemption treats it like any other running request.
        """
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus, *, free_blocks: bool = True) -> None:
        """End `req` (finished or aborted) wherever it is, freeing its blocks unless told not to
        (a prefill-only request keeps them pinned until the engine releases them)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        if free_blocks:
            self.bm.free(req)

    def _preempt(self, req: Request) -> None:
        self.bm.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
