"""Spans of a request's life inside one worker's engine: `queue`, `prefill`, `decode`.

    spans.admitted(request_id, parent, num_prompt_tokens, num_completions, prefill_only=...)
    spans.decoding(request_id, parent, num_prompt_tokens)  # StartDecode: the KV came by lease
    spans.on_step(running_views(engine.scheduler.running), step_started_ns)  # after each step
    spans.on_output(out, step_started_ns)                     # each output of the step
    spans.stopped(request_id, index)       # Cancel with a stop string (no engine output)

    queue    admitted .. first scheduled (the engine step that starts computing its prompt)
    prefill  first scheduled .. first token; one `prefill_chunk` event per step that computed
             part of the prompt (tokens, total computed); cached tokens as an attribute, and
             the vision encoder's seconds for its images (`llmfleet.encoder_seconds`)
    decode   first token (or StartDecode) .. the last completion finished; output tokens,
             finish reasons. One span per request, never one per token.

The spans are children of the RPC span that admitted the request (AddRequest, Prefill or
StartDecode) and may end after it. Only requests whose admission span records are followed:
with tracing off the table stays empty and the engine loop pays one truthiness test per step.
All methods run on the event loop. Admission ops post `admitted` / `decoding` there
(`EngineLoop.post`) before any step can schedule the request, and the steps' readings
(`running_views`, taken on the engine thread) and outputs reach `on_step` / `on_output` after
that, in step order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from llmfleet.engine.request import Request, RequestOutput

tracer = trace.get_tracer(__name__)


class RunningView(NamedTuple):
    """A running sequence's prompt progress, read on the engine thread after a step."""

    request_id: str  # the client's (a completion's parent)
    index: int
    num_cached_tokens: int
    num_computed_tokens: int
    encoder_seconds: float = 0.0  # vision encoder time spent on its images so far


def running_views(running: Iterable[Request]) -> list[RunningView]:
    return [
        RunningView(
            r.parent_id or r.request_id,
            r.index,
            r.num_cached_tokens or 0,
            r.num_computed_tokens,
            r.encoder_seconds,
        )
        for r in running
    ]


@dataclass
class _Life:
    parent: Context
    span: Span  # of the current phase
    phase: str  # "queue" | "prefill" | "decode"
    num_prompt_tokens: int
    num_completions: int
    prefill_only: bool
    num_computed: int = 0  # prompt tokens computed, as last seen
    num_output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


class RequestSpans:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._lives: dict[str, _Life] = {}  # by the client's request id
        self._num_prefilling = 0  # lives in queue or prefill
        # Admissions posted on the engine thread (`expect`) and run on the event loop: steps
        # between the two must read running views already. One writer each.
        self._num_expected = 0
        self._num_arrived = 0

    def __len__(self) -> int:
        return len(self._lives)

    def expect(self, parent: Span) -> None:
        """On the engine thread, as an admission op posts `admitted` / `decoding` for a
        recording `parent`: `following` holds from here, not only once the post has run."""
        if parent.is_recording():
            self._num_expected += 1

    @property
    def following(self) -> bool:
        """Some request is followed or about to be (read on the engine thread per step)."""
        return bool(self._lives) or self._num_expected != self._num_arrived

    def admitted(
        self,
        request_id: str,
        parent: Span,
        num_prompt_tokens: int,
        num_completions: int,
        *,
        prefill_only: bool,
    ) -> None:
        """Follow a request just added to the engine (`parent`: the admitting RPC's span)."""
        if not parent.is_recording():
            return
        self._num_arrived += 1
        ctx = trace.set_span_in_context(parent)
        span = tracer.start_span("queue", ctx, attributes=self._attrs())
        self._lives[request_id] = _Life(
            ctx, span, "queue", num_prompt_tokens, num_completions, prefill_only
        )
        self._num_prefilling += 1

    def decoding(self, request_id: str, parent: Span, num_prompt_tokens: int) -> None:
        """Follow a request that starts decoding on KV a prefill worker pushed."""
        if not parent.is_recording():
            return
        self._num_arrived += 1
        ctx = trace.set_span_in_context(parent)
        span = tracer.start_span("decode", ctx, attributes=self._attrs())
        self._lives[request_id] = _Life(ctx, span, "decode", num_prompt_tokens, 1, False)

    def on_step(self, running: Iterable[RunningView], step_started_ns: int) -> None:
        """After a step: requests it scheduled for the first time leave the queue, and each
        prompt chunk it computed is an event of the request's `prefill` span."""
        if not self._num_prefilling:
            return
        now = time.time_ns()
        for req in running:
            life = self._lives.get(req.request_id)
            if life is None or life.phase == "decode" or req.index != 0:
                continue
            if life.phase == "queue":
                self._start_prefill(life, req.num_cached_tokens, step_started_ns)
            self._chunk(life, req.num_computed_tokens, now)
            if req.encoder_seconds:
                life.span.set_attribute("llmfleet.encoder_seconds", req.encoder_seconds)

    def on_output(self, out: RequestOutput, step_started_ns: int) -> None:
        life = self._lives.get(out.request_id)
        if life is None:
            return
        now = time.time_ns()
        if life.phase != "decode" and out.new_token_ids:  # the first token: the prompt is done
            if life.phase == "queue":  # scheduled and done within one step
                self._start_prefill(life, out.num_cached_tokens, step_started_ns)
            self._chunk(life, life.num_prompt_tokens, now)
            life.span.end(now)
            self._num_prefilling -= 1
            if life.prefill_only:
                del self._lives[out.request_id]
                return
            life.phase = "decode"
            life.span = tracer.start_span(
                "decode", life.parent, attributes=self._attrs(), start_time=now
            )
        life.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            life.finish_reasons.append(out.finish_reason or "abort")
            if len(life.finish_reasons) >= life.num_completions:
                self._end(out.request_id, life, now)

    def stopped(self, request_id: str, index: int | None) -> None:
        """Completion `index` (None: every unfinished one) ended by a stop string that the
        router matched: the engine emits no output for it, so it is counted here."""
        life = self._lives.get(request_id)
        if life is None:
            return
        n = 1 if index is not None else life.num_completions - len(life.finish_reasons)
        life.finish_reasons.extend(["stop"] * n)
        if len(life.finish_reasons) >= life.num_completions:
            self._end(request_id, life, time.time_ns())

    def close(self) -> None:
        """End whatever is still open (the worker is stopping)."""
        now = time.time_ns()
        for request_id, life in list(self._lives.items()):
            self._end(request_id, life, now)

    # ---- helpers -----------------------------------------------------------------------------
    def _attrs(self) -> dict[str, str]:
        return {"llmfleet.worker_id": self.worker_id}

    def _start_prefill(self, life: _Life, num_cached: int, started_ns: int) -> None:
        life.span.end(started_ns)
        life.phase = "prefill"
        life.num_computed = num_cached
        attrs = {**self._attrs(), "llmfleet.usage.cached_tokens": num_cached}
        attrs["gen_ai.usage.input_tokens"] = life.num_prompt_tokens
        life.span = tracer.start_span(
            "prefill", life.parent, attributes=attrs, start_time=started_ns
        )

    def _chunk(self, life: _Life, num_computed: int, now: int) -> None:
        num_computed = min(num_computed, life.num_prompt_tokens)
        if num_computed > life.num_computed:
            life.span.add_event(
                "prefill_chunk",
                {
                    "llmfleet.chunk_tokens": num_computed - life.num_computed,
                    "llmfleet.computed_tokens": num_computed,
                },
                timestamp=now,
            )
            life.num_computed = num_computed

    def _end(self, request_id: str, life: _Life, now: int) -> None:
        if life.phase == "decode":
            life.span.set_attribute("gen_ai.usage.output_tokens", life.num_output_tokens)
        else:  # aborted (or the worker stopped) before its first token
            self._num_prefilling -= 1
        if life.finish_reasons:
            life.span.set_attribute("gen_ai.response.finish_reasons", life.finish_reasons)
        life.span.end(now)
        del self._lives[request_id]
