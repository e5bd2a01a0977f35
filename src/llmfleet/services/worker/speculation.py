"""Speculative decoding on a worker: its settings folded into the engine's config, its
Prometheus metrics, and the per-request draft counts its outputs carry to the router.

Decode and unified workers speculate; a prefill worker never does (its requests end at their
first token, there is nothing to draft for), so `fold_speculation` drops the settings there.
The engine counts (engine/spec_decode/, `engine.spec_stats`, `Request.num_draft_tokens`);
this module only reads the counters and reports their increase.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import prometheus_client

from llmfleet.engine.request import RequestOutput
from llmfleet.engine.spec_decode import threshold
from llmfleet.shared.core.config import EngineConfig, WorkerConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative_settings import SpeculativeSettings
from llmfleet.v1 import worker_pb2

logger = logging.getLogger(__name__)

# vLLM's spec-decode family, same meanings, under our prefix.
NUM_STEPS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_steps", "Engine steps that verified drafted tokens", ["model_name"]
)
# A sequence's step with drafts emits its accepted drafts and one token of the target's (fewer
# only when a stop ends it early), so drafts = emitted - accepted.
NUM_DRAFTS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_drafts",
    "Drafts verified: one per sequence per step that verified drafted tokens for it",
    ["model_name"],
)
NUM_DRAFT_TOKENS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_draft_tokens", "Tokens drafted and verified", ["model_name"]
)
NUM_ACCEPTED_TOKENS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_accepted_tokens", "Drafted tokens the target accepted", ["model_name"]
)
NUM_EMITTED_TOKENS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_emitted_tokens",
    "Tokens speculative steps emitted (accepted drafts plus the target's own token)",
    ["model_name"],
)
ACCEPTED_PER_POS = prometheus_client.Counter(
    "llmfleet:spec_decode_num_accepted_tokens_per_pos",
    "Drafted tokens accepted at each draft position (0: the first draft)",
    ["model_name", "position"],
)
MEAN_ACCEPTED_LENGTH = prometheus_client.Gauge(
    "llmfleet:spec_decode_mean_accepted_length",
    "Tokens a draft gave since the worker started: 1 + accepted tokens / drafts",
    ["model_name"],
)
DISABLE_BATCH_SIZE = prometheus_client.Gauge(
    "llmfleet:spec_decode_disable_batch_size",
    "Speculation runs while at most this many sequences run (0: never turned off)",
    ["model_name", "method"],
)


def fold_speculation(
    worker: WorkerConfig, engine: EngineConfig, settings: SpeculativeSettings
) -> tuple[WorkerConfig, EngineConfig]:
    """The worker's configs with its speculative settings in the EngineConfig: "auto" resolved
    for its device (threshold.py, logged). A prefill worker's settings are dropped."""
    if settings.enabled and worker.role == "prefill":
        logger.info("speculation: a prefill worker never speculates; its settings are ignored")
        return worker, engine
    limit = settings.fixed_disable_batch_size()
    config = settings.config(limit)
    if config is None:  # no method
        return worker, engine
    if settings.auto_threshold:
        limit, source = threshold.resolve(
            engine.device, config.method, config.num_speculative_tokens
        )
        config = dataclasses.replace(config, disable_batch_size=limit)
        logger.info("speculation: off above %d running sequences (auto: %s)", limit, source)
    try:
        return worker, dataclasses.replace(engine, speculative=config)
    except ValidationError as exc:  # e.g. a simulated model
        raise ValidationError("--speculative-method", exc.message) from None


class SpecMetrics:
    """The engine's speculation counters into Prometheus; `on_step` runs on the engine thread
    after each step (StepMetrics)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        name = engine.spec.model_id
        config = engine.config.speculative
        self.enabled = config is not None
        if config is not None:
            limit = config.disable_batch_size or 0
            DISABLE_BATCH_SIZE.labels(name, config.method).set(limit)
            logger.info(
                "speculation: %s, up to %d drafts per sequence, %s",
                config.method,
                config.num_speculative_tokens,
                f"off above {limit} running sequences" if limit else "at every batch size",
            )
        self._steps = NUM_STEPS.labels(name)
        self._drafts = NUM_DRAFTS.labels(name)
        self._draft_tokens = NUM_DRAFT_TOKENS.labels(name)
        self._accepted = NUM_ACCEPTED_TOKENS.labels(name)
        self._emitted = NUM_EMITTED_TOKENS.labels(name)
        self._mean = MEAN_ACCEPTED_LENGTH.labels(name)
        # Every position a draft can reach, at 0 from the start (position 0 when speculation is
        # off), so the dashboard's per-position panel always finds its series.
        positions = range(max(1, _k(config)))
        self._per_pos = [ACCEPTED_PER_POS.labels(name, str(i)) for i in positions]
        self._seen = (0, 0, 0, 0, 0)
        self._seen_pos = [0] * len(self._per_pos)

    def on_step(self) -> None:
        stats = getattr(self._engine, "spec_stats", None)
        if not self.enabled or stats is None:
            return
        drafts = stats.num_emitted - stats.num_accepted
        now = (stats.num_steps, drafts, stats.num_drafted, stats.num_accepted, stats.num_emitted)
        if now == self._seen:
            return
        counters = (self._steps, self._drafts, self._draft_tokens, self._accepted, self._emitted)
        for counter, value, seen in zip(counters, now, self._seen, strict=True):
            if value > seen:
                counter.inc(value - seen)
        self._seen = now
        for i, value in enumerate(stats.accepted_by_position[: len(self._per_pos)]):
            if value > self._seen_pos[i]:
                self._per_pos[i].inc(value - self._seen_pos[i])
                self._seen_pos[i] = value
        if drafts > 0:
            self._mean.set(stats.num_emitted / drafts)


def _k(config: Any) -> int:
    return 0 if config is None else int(config.num_speculative_tokens)


def spec_decode_stats(engine: Any) -> worker_pb2.SpecDecodeStats | None:
    """GetWorkerStats' `spec_decode`: the engine's settings and cumulative counts; None when it
    does not speculate. Engine thread (between steps: the counts are of whole steps)."""
    config = engine.config.speculative
    stats = getattr(engine, "spec_stats", None)
    if config is None or stats is None:
        return None
    return worker_pb2.SpecDecodeStats(
        method=config.method,
        num_speculative_tokens=config.num_speculative_tokens,
        disable_batch_size=config.disable_batch_size or 0,
        num_steps=stats.num_steps,
        num_draft_tokens=stats.num_drafted,
        num_accepted_tokens=stats.num_accepted,
        num_emitted_tokens=stats.num_emitted,
    )


class DraftCounts:
    """Per sequence, the draft counts already reported: outputs carry the increase since the
    previous one (messages are diffs; a migrated request's counts add up on the router).
    Engine thread only (ReplySinks)."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, int], tuple[int, int]] = {}

    def delta(self, out: RequestOutput) -> tuple[int, int]:
        """(drafted, accepted) since this sequence's previous output."""
        drafted, accepted = out.num_draft_tokens, out.num_accepted_tokens
        key = (out.request_id, out.index)
        if out.finished:
            before = self._sent.pop(key, (0, 0))
        elif drafted:
            before = self._sent.get(key, (0, 0))
            self._sent[key] = (drafted, accepted)
        else:
            return 0, 0
        return drafted - before[0], accepted - before[1]
