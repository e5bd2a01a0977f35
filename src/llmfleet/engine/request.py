"""A request's state inside the engine: one accounting model for every phase.

There is no prefill or decode phase: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (those whose KV is in the cache). Each step computes some of the rest;
when a step brings `num_computed_tokens` up to `num_tokens`, the step's last logits are
sampled and the new token is appended. Chunked prefill, prefix-cache hits and recompute after
preemption all fall out of this.

`status` and `num_computed_tokens` change only inside the engine core (the scheduler admits,
preempts and finishes; the engine and its decode chain advance them by what a step computed);
only the engine appends output tokens. `RequestOutput` is what a step reports of a sequence:
a diff, only its new tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmfleet.shared.core.block_hash import ROOT_HASH, HashContext, hash_block_chain
from llmfleet.shared.core.multimodal import ImageRef, PixelInput, mm_spans
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.pooling_params import PoolingParams
from llmfleet.shared.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; resumes by recompute
    FINISHED_STOPPED = "stop"  # eos, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    # Prefill-only request after its first token: out of the engine, its blocks still pinned
    # (readable) until the worker releases them. Not a finish reason of the API.
    PREFILLED = "prefilled"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.PREFILLED,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and params.stop_token_ids
    block_size: int
    hash_context: HashContext = field(default_factory=HashContext)
    generator: torch.Generator | None = None
    parent_id: str | None = None  # for n > 1: the client's request id
    index: int = 0  # which of the n completions
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_only: bool = False  # stop after the first token, keeping the blocks (see engine)
    # Structured output: the request's grammar matcher (engine/structured.py's `Matcher`), which
    # has accepted every output token; None when unconstrained.
    matcher: Any = None
    pooling: PoolingParams | None = None  # an embedding: pooled, never sampled (pooling.py)
    # The prompt's images (their placeholder runs enter the block hashes) and, for those the
    # encoder cache lacked at admission, their pixels (mm_inputs.py drops them once encoded).
    images: tuple[ImageRef, ...] = ()
    pixels: dict[str, PixelInput] = field(default_factory=dict)
    # M-RoPE models with images: the prompt's (3, num_prompt_tokens) int64 positions (CPU);
    # a later token at sequence index i has position i + rope_delta on every axis.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    encoder_seconds: float = 0.0  # vision encoder time spent on this request's images

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    num_cached_on_arrival: int = 0  # prefix-cache hit when queued (an estimate of the above)
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    stop_reason: int | str | None = None  # the token id or stop string that ended it
    # Speculative decoding: the drafts proposed for the next step (set by the engine before
    # scheduling; the scheduler may trim them), and the drafts verified and kept so far.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = hash_block_chain(
            self.all_token_ids, self.block_size, self.hash_context, mm_spans(self.images)
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            # A block just filled: extend the hash chain by one block.
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            self.block_hashes.extend(
                hash_block_chain(
                    self.all_token_ids,
                    self.block_size,
                    self.hash_context,
                    mm_spans(self.images),
                    start_block=len(self.block_hashes),
                    parent=parent,
                )
            )


@dataclass
class RequestOutput:
    """What one step produced for one sequence (a diff: only the new tokens)."""

    request_id: str  # the client's request id
    index: int  # which of the n completions
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # stop token id or stop string, when one ended it
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int = 0  # tokens generated so far, these included
    num_draft_tokens: int = 0  # speculative drafts verified so far (cumulative)
    num_accepted_tokens: int = 0  # of which kept

    @classmethod
    def of(
        cls, req: Request, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> RequestOutput:
        """`req`'s output at its current status, with these new tokens."""
        finished = req.is_finished
        return cls(
            request_id=req.parent_id or req.request_id,
            index=req.index,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=(
                req.status.value if finished and req.status is not RequestStatus.PREFILLED else None
            ),
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_output_tokens=req.num_output_tokens,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )
