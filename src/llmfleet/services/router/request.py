"""One client request inside the router: its completions, where they run, what was streamed.

A request is submitted as one or more *legs*. A leg is one submission to one worker under a
wire id (the id the worker and the reply endpoint know it by); wire index i of a leg is
completion `indices[i]` of the request. Normally there is one leg holding all n completions;
after a migration each unfinished completion that already streamed tokens runs as its own leg
(n=1, prompt + its streamed tokens). Late outputs of an abandoned leg never reach the request:
its wire id is unregistered from the reply endpoint and outputs from another worker are ignored.

Everything here is owned by the request's own task (the Generate handler), except `events`,
which the reply endpoint, the failure detector and Abort feed. An `Outputs` event is what one
worker step gave one leg; when the request's stream writes fall behind the engine's steps,
`next_event` joins the `Outputs` already waiting into one, so that one message carries several
steps' tokens instead of one message per step (each step's arrival time is kept for the
latency metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context

from llmfleet.services.router.detok import DetokSequence
from llmfleet.services.router.replies import merge_outputs
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import ImageRef
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.v1 import common_pb2, dataplane_pb2


@dataclass(frozen=True)
class Lease:
    """An open KV reservation on a decode worker (disaggregated handoff)."""

    lease_id: str
    epoch: int
    decode_worker_id: str
    kv_endpoint: str
    expires_at_unix_ms: int
    num_blocks: int


@dataclass
class Leg:
    wire_id: str
    worker_id: str
    indices: tuple[int, ...]
    open_indices: set[int] = field(default_factory=set)  # wire indices the worker still runs
    prefill_tokens: int = 0  # prompt tokens it still counts in its worker's queue (placement)
    fetch_tokens: int = 0  # and prompt tokens it counts as fetched there from the kvstore

    def __post_init__(self) -> None:
        self.open_indices = set(range(len(self.indices)))


@dataclass
class CompletionState:
    """The router's bookkeeping of one completion in flight: its detokenizer stream and the
    tokens streamed so far (what a migration resubmits)."""

    index: int
    detok: DetokSequence
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""  # "stop" | "length" | "abort" once finished
    # Speculative decoding: tokens drafted for it and accepted, over every worker it ran on.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def count_drafts(self, out: dataplane_pb2.SequenceOutput) -> None:
        """Add a worker output's draft counts (each output carries its increase)."""
        self.num_draft_tokens += out.num_draft_tokens
        self.num_accepted_tokens += out.num_accepted_tokens


@dataclass(slots=True)
class Outputs:
    """Outputs of a leg from its worker's steps (one step, or several joined)."""

    leg: Leg
    worker_id: str
    outs: Sequence[dataplane_pb2.SequenceOutput]
    arrived: list[float]  # perf_counter when each step's outputs reached the router


@dataclass(frozen=True)
class WorkerFailed:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Aborted:
    pass


@dataclass
class RequestRun:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str
    model: ModelInfo
    block_hashes: list[bytes]
    completions: list[CompletionState]
    # The prompt's images (placeholder runs in prompt_ids), forwarded to every worker it meets.
    images: tuple[ImageRef, ...] = ()
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    legs: dict[str, Leg] = field(default_factory=dict)
    lease: Lease | None = None
    excluded: set[str] = field(default_factory=set)  # workers that failed this request
    num_legs: int = 0
    num_retries: int = 0
    num_cached_tokens: int = 0
    submitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    aborted: bool = False
    trace: Context = field(default_factory=Context)  # its `llm_request` span (spans.py)
    workers_used: list[str] = field(default_factory=list)  # every worker it ran on, in order
    # prompt tokens the latest prefix-counting decision's worker computes (not cached there,
    # not fetched from the kvstore); 0: no such decision yet
    routed_uncached_tokens: int = 0
    routed_fetched_tokens: int = 0  # and the prompt tokens it fetches from the kvstore
    session_id: str = ""  # the client's conversation id: a routing hint (placement.py)
    predicted_ttft: tuple[str, float, float] | None = None  # policy, routed at, predicted s
    _carried: object | None = None  # taken from `events` by next_event, not handled yet

    async def next_event(self) -> object:
        """The next event: output events of one leg and worker already waiting are joined."""
        ev = self._carried if self._carried is not None else await self.events.get()
        self._carried = None
        if isinstance(ev, Outputs):
            ev, self._carried = take_ready(self.events, ev)
        return ev

    def used(self, worker_id: str) -> None:
        if worker_id not in self.workers_used:
            self.workers_used.append(worker_id)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.completions)

    def next_wire_id(self) -> str:
        """The wire id of the next leg: the request id, then `<request id>/<leg number>`."""
        return self.request_id if self.num_legs == 0 else f"{self.request_id}/{self.num_legs}"

    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.num_completion_tokens(),
            cached_prompt_tokens=min(self.num_cached_tokens, len(self.prompt_ids)),
            num_draft_tokens=sum(c.num_draft_tokens for c in self.completions),
            num_accepted_tokens=sum(c.num_accepted_tokens for c in self.completions),
        )

    def legs_on(self, worker_id: str, wire_ids: set[str]) -> list[str]:
        """Which of legs `wire_ids` of this request run on the worker."""
        return [
            g.wire_id
            for g in self.legs.values()
            if g.worker_id == worker_id and g.wire_id in wire_ids
        ]

    def worker_ids(self) -> set[str]:
        ids = {leg.worker_id for leg in self.legs.values()}
        if self.lease is not None:
            ids.add(self.lease.decode_worker_id)
        return ids


def take_ready(queue: asyncio.Queue[object], first: Outputs) -> tuple[Outputs, object | None]:
    """`first`, taken from `queue`, joined with the `Outputs` of the same leg and worker
    waiting behind it; and the next event that could not be joined (or None), which the
    caller handles next."""
    joined: list[Outputs] = []
    nxt = None
    while not queue.empty():
        nxt = queue.get_nowait()
        if not (
            isinstance(nxt, Outputs) and nxt.leg is first.leg and nxt.worker_id == first.worker_id
        ):
            break
        joined.append(nxt)
        nxt = None
    if not joined:
        return first, nxt
    outs = [*first.outs]
    arrived = [*first.arrived]
    for ev in joined:
        outs.extend(ev.outs)
        arrived.extend(ev.arrived)
    return Outputs(first.leg, first.worker_id, merge_outputs(outs), arrived), nxt
