"""The virtual fleet's parts that are plain data: a worker's calibration, the fleet's shape,
a simulated request (and what happened to it), and the event clock (virtual_fleet.py runs
them)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from llmfleet.shared.core.config import EngineConfig


@dataclass(frozen=True)
class Calibration:
    """One worker: the simulated engine's step times (defaults: an 8B model on one H100, as
    `EngineConfig.sim_*`), its KV cache and batch limits, and moving KV (a kvstore fetch or a
    prefill→decode push, per token: 128 KiB of an 8B model's KV at about 25 GB/s)."""

    step_ms: float = 5.5
    decode_ms_per_seq: float = 0.055
    prefill_ms_per_token: float = 0.04
    fetch_ms_per_token: float = 0.005
    num_kv_blocks: int = 27_648  # 54 GiB of 128 KiB tokens in blocks of 16
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    store_blocks: int = 1 << 19  # the kvstore's RAM: 8 Mi tokens, 1 TiB at 128 KiB
    max_prefills_per_worker: int = 8  # RouterConfig's default

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            simulate=True,
            sim_step_ms=self.step_ms,
            sim_decode_ms_per_seq=self.decode_ms_per_seq,
            sim_prefill_ms_per_token=self.prefill_ms_per_token,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            async_scheduling=False,
            num_threads=1,  # a simulated step computes nothing; one process per core
        )


@dataclass(frozen=True)
class FleetShape:
    workers: int
    disaggregated: bool = False  # half prefill, half decode workers
    kvstore: bool = False


@dataclass
class SimRequest:
    rid: str
    arrival: float
    prompt: list[int]
    max_tokens: int
    hashes: list[bytes] = field(default_factory=list)  # the fleet fills them in
    first_token_at: float | None = None
    finished_at: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # found in the prefix cache or fetched, not computed
    predicted_ttft: float | None = None
    uncached_tokens: int = 0  # of the prompt, as the router saw it when it routed
    fetched_tokens: int = 0  # and fetched from the kvstore
    decode_worker_id: str = ""  # disaggregated: the decode worker leased for it
    num_prompt_tokens: int = 0
    num_question_tokens: int = 0  # the prompt's own tail after its tenant's shared prefix

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt)

    @property
    def ttft(self) -> float:
        assert self.first_token_at is not None
        return self.first_token_at - self.arrival


class Clock:
    """Virtual time: callbacks run in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), fn))

    def run(self) -> None:
        while self._queue:
            self.now, _, fn = heapq.heappop(self._queue)
            fn()
