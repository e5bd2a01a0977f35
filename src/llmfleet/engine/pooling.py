"""Embeddings through the engine: a prompt run like a prefill, its hidden states pooled.

    engine.pooler.add("e1", token_ids, PoolingParams(pooling="mean"), on_done=callback)
    while engine.has_unfinished():
        engine.step()                   # callback(PoolingOutput) once the prompt is computed

An embedding is a `Request` with `pooling` set. The scheduler batches it with every other
request (chunked like any prompt, preempted and recomputed like any request); the runner keeps
the step's final-norm hidden states (`ModelRunner.last_hidden`, the model's output before the
LM head) and never samples it. After each step `collect` pools the rows of each embedding's
tokens: "last" keeps the last token's row, "mean" sums every chunk's rows in float32. When the
prompt is computed the request ends at once and its blocks are freed.

No KV outlives the request: its block chain is empty, so it neither takes prefix-cache hits (a
hit would skip tokens that mean pooling needs) nor registers its blocks (no KV events, nothing
for the kvstore). Under tensor parallelism the hidden states are replicated on every rank, so
rank 0 pools them alone.

Who mutates what: `add` queues into the scheduler, `collect` (the engine, after a step) and
`abort` end requests through `Scheduler.finish`; `on_done` runs on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.scheduler import Scheduler, SchedulerOutput
from llmfleet.models.loader import ModelSpec
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.pooling_params import PoolingParams, check_dimensions
from llmfleet.shared.core.sampling_params import SamplingParams


class EngineParts(Protocol):
    """What `Pooler.for_engine` reads of an engine (engine.py's LLMEngine)."""

    spec: ModelSpec
    scheduler: Scheduler
    block_manager: BlockManager
    max_model_len: int
    model: Any
    simulated: bool


_NO_SAMPLING = SamplingParams(max_tokens=1)  # an embedding's Request needs some; never used


@dataclass(frozen=True)
class PoolingOutput:
    request_id: str
    embedding: list[float]  # hidden size, or params.dimensions values
    num_prompt_tokens: int


OnDone = Callable[[PoolingOutput], None]


@dataclass
class _Pooling:
    req: Request
    on_done: OnDone
    total: torch.Tensor | None = None  # (hidden,) float32: mean pooling's sum so far


@dataclass(frozen=True)
class Matryoshka:
    """Whether the model's embeddings may be shortened (`dimensions`), from its config's
    `is_matryoshka` / `matryoshka_dimensions` (the sentence-transformers convention vLLM reads)."""

    enabled: bool = False
    dimensions: tuple[int, ...] = ()  # the sizes it was trained at; empty: any

    @classmethod
    def of(cls, model: object) -> Matryoshka:
        config = getattr(model, "config", None)
        dims = tuple(int(d) for d in getattr(config, "matryoshka_dimensions", None) or ())
        return cls(bool(getattr(config, "is_matryoshka", False)) or bool(dims), dims)


class Pooler:
    def __init__(
        self,
        spec: ModelSpec,
        scheduler: Scheduler,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        matryoshka: Matryoshka,
        has_hidden_states: bool = True,
    ) -> None:
        self.spec = spec
        self.scheduler = scheduler
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.matryoshka = matryoshka
        self.has_hidden_states = has_hidden_states  # False: a simulated model
        self._active: dict[str, _Pooling] = {}

    @classmethod
    def for_engine(cls, engine: EngineParts) -> Pooler:
        """The pooler of `engine`'s scheduler, cache and model."""
        return cls(
            engine.spec,
            engine.scheduler,
            engine.block_manager,
            max_model_len=engine.max_model_len,
            matryoshka=Matryoshka.of(engine.model),
            has_hidden_states=not engine.simulated,
        )

    def check(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        *,
        field: str = "prompt_token_ids",
    ) -> None:
        """ValidationError naming `field` (the input), `dimensions` or `request_id`."""
        if not self.has_hidden_states:
            raise ValidationError(field, "a simulated model has no hidden states to embed")
        if not request_id:
            raise ValidationError("request_id", "must not be empty")
        if request_id in self._active or request_id in self.bm.req_blocks:
            raise ValidationError("request_id", f"{request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValidationError(field, "must not be empty")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValidationError(
                field,
                f"has {len(prompt_token_ids)} tokens, more than the context length of "
                f"{self.max_model_len} tokens",
            )
        vocab = self.spec.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValidationError(
                    field, f"token id {t!r} at position {i} is outside the vocabulary [0, {vocab})"
                )
        if self.bm.blocks_needed(len(prompt_token_ids)) > self.bm.num_blocks:
            raise ValidationError(
                field,
                f"{len(prompt_token_ids)} tokens need more KV blocks than this worker's whole "
                f"cache has ({self.bm.num_blocks})",
            )
        m = self.matryoshka
        check_dimensions(params.dimensions, self.spec.hidden_size, m.enabled, m.dimensions)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        on_done: OnDone,
        *,
        field: str = "prompt_token_ids",
    ) -> None:
        """Validate (`check`) and queue an embedding; `on_done` gets its output."""
        self.check(request_id, prompt_token_ids, params, field=field)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=_NO_SAMPLING,
            stop_token_ids=frozenset(),
            block_size=self.bm.block_size,
            pooling=params,
        )
        req.block_hashes = []  # no prefix-cache hits, nothing registered (module docstring)
        self._active[request_id] = _Pooling(req, on_done)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Drop an embedding (its blocks freed); False when it is not running here."""
        p = self._active.pop(request_id, None)
        if p is None:
            return False
        self.scheduler.finish(p.req, RequestStatus.FINISHED_ABORTED)
        return True

    @property
    def num_active(self) -> int:
        return len(self._active)

    def collect(self, sched: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """Pool the embeddings' rows of a step just launched (before the engine advances its
        requests); `hidden`: the step's (num_tokens, hidden) states, rows in `sched` order."""
        if not self._active:
            return
        offset = 0
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start, offset = offset, offset + n
            p = self._active.get(req.request_id) if req.pooling is not None else None
            if p is None:
                continue
            if hidden is None:
                raise RuntimeError("the runner kept no hidden states for an embedding's step")
            rows = hidden[start : start + n]  # (n, hidden)
            if req.num_computed_tokens == 0:  # its first chunk (again, after a preemption)
                p.total = None
            if req.pooling.pooling == "mean":
                chunk = rows.float().sum(dim=0)
                p.total = chunk if p.total is None else p.total + chunk
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            mean = req.pooling.pooling == "mean" and p.total is not None
            pooled = p.total / req.num_prompt_tokens if mean else rows[-1].float()
            del self._active[req.request_id]
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            embedding = _finish(pooled, req.pooling)
            p.on_done(PoolingOutput(req.request_id, embedding, req.num_prompt_tokens))


def _finish(pooled: torch.Tensor, params: PoolingParams) -> list[float]:
    """Shorten (`dimensions`) then normalize a pooled (hidden,) float32 vector."""
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=0)
    return pooled.cpu().tolist()
