"""A real disaggregated fleet (one process per service) exporting over OTLP/HTTP to a collector
in this test: one request is one trace across five processes, each under its own service name,
and the KV transfer's two halves sit in two worker processes, linked parent to child."""

from __future__ import annotations

import time

import pytest
from otlp_collector import HTTPCollector

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient


@pytest.fixture(scope="module")
def collector():
    with HTTPCollector() as c:
        yield c


def test_one_trace_across_processes(make_checkpoint_module, collector):
    model = str(make_checkpoint_module("llama"))
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms of a span's end
    }
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=model,
        env=env,
        extra_args={
            "worker": ["--num-kv-blocks", "64", "--block-size", "4"],
            "router": ["--short-prompt-threshold", "8"],
        },
        startup_timeout_s=240,
    )
    with Fleet(spec) as fleet:
        # ignore_eos: a first token that is EOS would finish the request on the prefill worker,
        # with no decode span to wait for (random weights sample it about once in 260 runs).
        result = GenerationClient(fleet.endpoint).generate(
            "the quick brown fox jumps over the lazy dog",
            raw=True,
            max_tokens=4,
            temperature=0,
            ignore_eos=True,
        )
        assert result.usage.completion_tokens == 4
        deadline = time.monotonic() + 30
        while not {s.name for _, s in collector.spans()} >= {"llm_request", "decode"}:
            if time.monotonic() > deadline:
                arrived = sorted(f"{svc}:{s.name}" for svc, s in collector.spans())
                pytest.fail(f"llm_request and decode not exported in 30 s; arrived: {arrived}")
            time.sleep(0.1)
    spans = collector.spans()  # the fleet has stopped: every exporter flushed at exit
    [root] = [s for _, s in spans if s.name == "llm_request"]
    assert root.attributes  # the collector got attributes over the wire
    trace = [(svc, s) for svc, s in spans if s.trace_id == root.trace_id]
    # Only the request was traced (no heartbeats, registrations, health checks or KV events).
    assert len(trace) == len(spans)
    services = {svc for svc, _ in trace}
    assert services == {
        "llmfleet-router",
        "llmfleet-tokenizer",
        "llmfleet-worker",
        "llmfleet-kvstore",
    }
    by_id = {s.span_id: (svc, s) for svc, s in trace}
    for svc, s in trace:
        if s is not root:
            assert s.parent_span_id in by_id, f"{s.name} ({svc}) has a parent outside the trace"
    # The KV transfer: kv_push in the prefill worker, kv_receive (its child) in the decode one.
    [push] = [s for _, s in trace if s.name == "kv_push"]
    receives = [s for _, s in trace if s.name == "kv_receive"]
    assert receives and all(r.parent_span_id == push.span_id for r in receives)
    worker_of = {
        s.span_id: a.value.string_value
        for _, s in trace
        for a in s.attributes
        if a.key == "llmfleet.worker_id"
    }
    [prefill] = [s for _, s in trace if s.name == "prefill"]
    [decode] = [s for _, s in trace if s.name == "decode"]
    assert worker_of[prefill.span_id] != worker_of[decode.span_id]
    usage = {a.key: a.value.int_value for a in root.attributes if a.key.startswith("gen_ai.usage")}
    assert usage == {
        "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": result.usage.completion_tokens,
    }
