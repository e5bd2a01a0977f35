"""Where a worker's step outputs go: `TokenBatch` pushes to reply endpoints, and metrics.

`IterationFacts` is what the event loop learns of the engine after an iteration, read on the
engine thread right after it (the thread may be steps further when the event loop handles it);
`WorkerCounters.report` turns it into the load and prefix-cache metrics.

The pushes leave from the engine thread, right after the step that made them (`EngineLoop`'s
`on_step`), not after a hop to the event loop, which would lie on every first token's way to
the client. One PUSH socket per distinct reply endpoint, created on first use (linger 0) on a
shadow of the worker's ZMQ context and touched only by the engine thread (ZMQ sockets are not
thread-safe). Sends never block the step: a requester that stopped reading (its queue full)
loses messages, with a log line; the router notices a dead peer by its own means.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import prometheus_client
import torch
import zmq
import zmq.asyncio

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.flops import StepCost
from llmfleet.engine.request import RequestOutput
from llmfleet.services.worker.request_spans import RunningView, running_views
from llmfleet.services.worker.speculation import DraftCounts, SpecMetrics
from llmfleet.shared.core.step_model import StepTimeModel
from llmfleet.shared.wire.convert import FINISH_TO_PB, logprobs_to_pb
from llmfleet.shared.wire.metrics import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from llmfleet.shared.wire.tls import blocking_shadow
from llmfleet.v1 import common_pb2, dataplane_pb2

logger = logging.getLogger(__name__)

# Metric names follow vLLM's, so existing dashboards read them.
KV_USAGE = prometheus_client.Gauge(
    "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", ["model_name"]
)
PROMPT_TOKENS = prometheus_client.Counter(
    "vllm:prompt_tokens", "Prompt tokens admitted", ["model_name"]
)
GENERATION_TOKENS = prometheus_client.Counter(
    "vllm:generation_tokens", "Tokens generated", ["model_name"]
)
PREFIX_QUERIES = prometheus_client.Counter(
    "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model_name"]
)
ENGINE_STEP_SECONDS = prometheus_client.Histogram(
    "llmfleet:engine_step_seconds",
    "Wall time of one engine step (forward pass + sampling) on the worker",
    ["model_name"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PREFIX_HITS = prometheus_client.Counter(
    "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", ["model_name"]
)
NUM_PREEMPTIONS = prometheus_client.Counter(
    "vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later)", ["model_name"]
)
CHAINED_STEPS = prometheus_client.Counter(
    "llmfleet:engine_chained_steps",
    "Decode steps launched before the previous step's tokens were read back (async scheduling)",
    ["model_name"],
)
ENCODER_CACHE_HITS = prometheus_client.Counter(
    "llmfleet:encoder_cache_hits",
    "Images whose vision-encoder output was cached when a request first needed it",
    ["model_name"],
)
ENCODER_CACHE_MISSES = prometheus_client.Counter(
    "llmfleet:encoder_cache_misses", "Images the vision encoder ran on", ["model_name"]
)
REQUEST_ENCODER_SECONDS = prometheus_client.Histogram(
    "llmfleet:request_encoder_seconds",
    "Vision-encoder time spent on one request's images (requests with images, at their end)",
    ["model_name"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
CACHE_CONFIG_INFO = prometheus_client.Gauge(
    "vllm:cache_config_info",
    "KV cache configuration, in the labels (the value is always 1)",
    ["model_name", "block_size", "num_gpu_blocks", "cache_dtype"],
)
# The model's work as `flops.estimate_step_cost` counts it, per device: rate() over a device's
# peak FLOP/s and bytes/s is MFU and bandwidth use (the dashboard templates the peaks).
ESTIMATED_FLOPS = prometheus_client.Counter(
    "llmfleet:estimated_flops",
    "Estimated FLOPs of the model's forward passes",
    ["model_name", "device"],
)
ESTIMATED_READ_BYTES = prometheus_client.Counter(
    "llmfleet:estimated_read_bytes",
    "Estimated bytes the forward passes read (weights once per step, KV context)",
    ["model_name", "device"],
)
ESTIMATED_WRITE_BYTES = prometheus_client.Counter(
    "llmfleet:estimated_write_bytes",
    "Estimated bytes the forward passes write (new K and V)",
    ["model_name", "device"],
)


def device_label(device: torch.device) -> str:
    """`cpu`, `cuda:0`, ...: a CUDA device without an index is the current one."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


class StepMetrics:
    """The engine-level metrics the engine loop updates after each step it ran; created with
    the engine (which publishes the cache configuration once)."""

    def __init__(self, engine: LLMEngine) -> None:
        name = engine.spec.model_id
        bm = engine.block_manager
        CACHE_CONFIG_INFO.labels(
            name,
            str(bm.block_size),
            str(bm.num_blocks),
            str(engine.kv.dtype).removeprefix("torch."),
        ).set(1)
        device = device_label(engine.device)
        self._seconds = ENGINE_STEP_SECONDS.labels(name)
        self._flops = ESTIMATED_FLOPS.labels(name, device)
        self._read = ESTIMATED_READ_BYTES.labels(name, device)
        self._write = ESTIMATED_WRITE_BYTES.labels(name, device)
        self._preemptions = NUM_PREEMPTIONS.labels(name)
        self._scheduler = engine.scheduler
        self._preemptions_seen = engine.scheduler.num_preemptions_total
        self._chained = CHAINED_STEPS.labels(name)
        self._chain = engine.chain
        self._chained_seen = engine.chain.num_chained_steps
        self._mm = engine.mm
        self._mm_seen = (engine.mm.num_hits, engine.mm.num_misses)
        self._encoder_hits = ENCODER_CACHE_HITS.labels(name)
        self._encoder_misses = ENCODER_CACHE_MISSES.labels(name)
        self._encoder_seconds = REQUEST_ENCODER_SECONDS.labels(name)
        self._spec = SpecMetrics(engine)
        self.step_model = StepTimeModel()  # what the router's scorer predicts with

    def on_step(self, seconds: float, cost: StepCost, work: tuple[int, int] = (0, 0)) -> None:
        """`work`: (prompt tokens, decoded sequences) of the step (engine.last_step_work)."""
        self._seconds.observe(seconds)
        self.step_model.observe(seconds, prefill_tokens=work[0], decode_seqs=work[1])
        preempted = self._scheduler.num_preemptions_total - self._preemptions_seen
        if preempted:
            self._preemptions.inc(preempted)
            self._preemptions_seen += preempted
        chained = self._chain.num_chained_steps - self._chained_seen
        if chained:
            self._chained.inc(chained)
            self._chained_seen += chained
        mm = self._mm
        if (mm.num_hits, mm.num_misses) != self._mm_seen:
            self._encoder_hits.inc(mm.num_hits - self._mm_seen[0])
            self._encoder_misses.inc(mm.num_misses - self._mm_seen[1])
            self._mm_seen = (mm.num_hits, mm.num_misses)
        if mm.finished_encodes:
            for _, seconds in mm.finished_encodes:
                self._encoder_seconds.observe(seconds)
            mm.finished_encodes.clear()
        if self._spec.enabled:
            self._spec.on_step()
        self._flops.inc(cost.flops)
        self._read.inc(cost.read_bytes)
        self._write.inc(cost.write_bytes)


def sequence_output_to_pb(
    out: RequestOutput, drafts: tuple[int, int] = (0, 0)
) -> dataplane_pb2.SequenceOutput:
    """`drafts`: (drafted, accepted) tokens since the sequence's previous output."""
    pb = dataplane_pb2.SequenceOutput(
        request_id=out.request_id,
        index=out.index,
        token_ids=out.new_token_ids,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_draft_tokens=drafts[0],
        num_accepted_tokens=drafts[1],
    )
    if any(lp is not None for lp in out.new_logprobs):
        pb.logprobs.extend(logprobs_to_pb(lp) for lp in out.new_logprobs if lp is not None)
    if out.finish_reason is not None:
        pb.finish_reason = FINISH_TO_PB[out.finish_reason]
        if isinstance(out.stop_reason, int):
            pb.stop_token_id = out.stop_reason
    return pb


class ReplySinks:
    """TokenBatch pushes; every method runs on the engine thread (see the module docstring),
    except `close` when that thread is still busy at stop (WorkerRuntime.stop)."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str) -> None:
        self.ctx = blocking_shadow(ctx)  # blocking sockets, same context and CURVE keys
        self.worker_id = worker_id
        self._socks: dict[str, zmq.Socket] = {}
        self._drafts = DraftCounts()

    def _sock(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        return sock

    def send(self, step: int, outputs: list[RequestOutput], endpoint_of: dict[str, str]) -> None:
        """One TokenBatch per endpoint with that endpoint's outputs; requests without a route
        (prefill-only ones, whose output the prefill side takes) are skipped."""
        by_endpoint: dict[str, list[dataplane_pb2.SequenceOutput]] = defaultdict(list)
        for out in outputs:
            endpoint = endpoint_of.get(out.request_id)
            if endpoint:
                by_endpoint[endpoint].append(sequence_output_to_pb(out, self._drafts.delta(out)))
        for endpoint, seq_outputs in by_endpoint.items():
            batch = dataplane_pb2.TokenBatch(
                worker_id=self.worker_id, step=step, outputs=seq_outputs
            )
            try:
                self._sock(endpoint).send(batch.SerializeToString(), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("reply endpoint %s is not reading; step %d dropped", endpoint, step)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()


@dataclass(frozen=True)
class IterationFacts:
    """What the event loop needs of the engine after one iteration (see the module docstring)."""

    started_ns: int  # the step's start, wall clock
    running: Sequence[RunningView]  # only when tracing follows some request (else empty)
    stored: list[bytes]  # KV events since the last iteration
    removed: list[bytes]
    ended: list[str]  # requests that ended with this step (their routes can go)
    num_running: int
    num_waiting: int
    num_queued_prompt_tokens: int  # admitted, not computed yet
    kv_usage: float
    prefix_queries: int
    prefix_hits: int

    @classmethod
    def read(
        cls, engine: LLMEngine, outputs: list[RequestOutput], started_ns: int, spans: bool
    ) -> IterationFacts:
        """On the engine thread; `spans`: tracing follows some request."""
        stored, removed = engine.kv.drain_events()
        stats = engine.block_manager.stats
        ended = [
            o.request_id for o in outputs if o.finished and not engine.has_request(o.request_id)
        ]
        return cls(
            started_ns=started_ns,
            running=running_views(engine.scheduler.running) if spans else (),
            stored=stored,
            removed=removed,
            ended=ended,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_queued_prompt_tokens=engine.scheduler.num_queued_prompt_tokens,
            kv_usage=engine.block_manager.usage,
            prefix_queries=stats.num_queries,
            prefix_hits=stats.num_hits,
        )


@dataclass
class WorkerCounters:
    prefix_queries_reported: int = 0  # already added to the Prometheus counters
    prefix_hits_reported: int = 0

    def report(self, name: str, num_generated: int, facts: IterationFacts) -> None:
        """On the event loop: the metrics of model `name` after an iteration."""
        NUM_REQUESTS_RUNNING.labels(name).set(facts.num_running)
        NUM_REQUESTS_WAITING.labels(name).set(facts.num_waiting)
        KV_USAGE.labels(name).set(facts.kv_usage)
        if num_generated:
            GENERATION_TOKENS.labels(name).inc(num_generated)
        if facts.prefix_queries > self.prefix_queries_reported:
            PREFIX_QUERIES.labels(name).inc(facts.prefix_queries - self.prefix_queries_reported)
            self.prefix_queries_reported = facts.prefix_queries
        if facts.prefix_hits > self.prefix_hits_reported:
            PREFIX_HITS.labels(name).inc(facts.prefix_hits - self.prefix_hits_reported)
            self.prefix_hits_reported = facts.prefix_hits


def load_report(
    engine: LLMEngine,
    step_model: StepTimeModel | None,
    *,
    num_queued_prompt_tokens: int,
    num_active_leases: int = 0,
    fetch_s_per_token: float | None = None,
) -> common_pb2.LoadReport:
    """What a worker tells the router of its load: the engine's queues and cache, and the
    step times it measured (`step_model`; a figure it has not measured yet is sent as 0, for
    the router's prior). `fetch_s_per_token`: its measured kvstore fetch cost, if any."""
    report = common_pb2.LoadReport(
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        num_free_blocks=engine.num_free_blocks,
        num_total_blocks=engine.block_manager.num_blocks,
        num_active_leases=num_active_leases,
        num_queued_prompt_tokens=num_queued_prompt_tokens,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
    )
    if step_model is not None and step_model.num_decode_steps:
        report.step_seconds = step_model.step_s
        report.step_seconds_per_seq = step_model.step_s_per_seq
    if step_model is not None and step_model.num_prefill_steps:
        report.prefill_seconds_per_token = step_model.prefill_s_per_token
    if fetch_s_per_token is not None:
        report.fetch_seconds_per_token = fetch_s_per_token
    return report
