"""Every service's /metrics after traffic through a real disaggregated fleet with a kvstore:
each named metric is there, with values that agree with what the client saw (token usage,
finish reasons, request counts), with the KV that moved (lease transfers, kvstore fetches) and
with the model's shape (estimated FLOPs and bytes)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from promql import dashboard_metric_names

from llmfleet.cli.fleet_plan import Child, FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.client.messages import GenerateResult
from llmfleet.engine.flops import model_shape
from llmfleet.models.loader import load_model

BS, NUM_BLOCKS = 16, 512
WORKER_ARGS = ["--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BS)]
SHORT = 16  # prompts shorter than this skip the lease (the decode worker prefills them)
PREFIX = list(range(10, 58))  # 48 tokens: three full blocks every long prompt shares
MAX_TOKENS = 5
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS}

Samples = list[tuple[str, dict[str, str], float]]


@pytest.fixture(scope="module")
def model(make_checkpoint_module) -> str:
    return str(make_checkpoint_module("qwen2"))


@pytest.fixture(scope="module")
def fleet(model, tmp_path_factory):
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=model,
        extra_args={
            "worker": WORKER_ARGS,
            "router": ["--short-prompt-threshold", str(SHORT)],
            "kvstore": ["--disk-dir", str(tmp_path_factory.mktemp("kvdisk"))],
        },
        startup_timeout_s=240,
        gateway=True,  # its /metrics too
        http_port=0,
    )
    with Fleet(spec) as f:
        yield f


def scrape(child: Child) -> Samples:
    with urllib.request.urlopen(child.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def has(samples: Samples, name: str, **labels: str) -> bool:
    return any(
        n == name and all(lab.get(k) == x for k, x in labels.items()) for n, lab, _ in samples
    )


def scrape_all(fleet: Fleet) -> dict[str, Samples]:
    return {c.name: scrape(c) for c in fleet.children}


def wait_for(fleet: Fleet, child: str, name: str, at_least: float, **labels: str) -> None:
    deadline = time.monotonic() + 10
    while total(scrape(fleet.child(child)), name, **labels) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{child}: {name}{labels} stayed below {at_least}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def traffic(fleet):
    """Runs the requests once; returns (results, scrapes before, after the warm-up, at the end)."""
    client = GenerationClient(fleet.endpoint)
    # One through the OpenAI gateway, before the first scrape: its metrics exist from then on,
    # and it counts in no delta below (the router's e2e count includes it).
    body = {"model": client.model_info().model_id, "prompt": "hello gateway", "max_tokens": 2}
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{fleet.http_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        ),
        timeout=60,
    ) as r:
        assert r.status == 200
    before = scrape_all(fleet)
    # Warm-up, n=2: served by the decode worker alone, which puts the shared prefix's blocks
    # into the kvstore; the prefill worker then fetches them for the first long prompt.
    warm = client.generate(token_ids=[*PREFIX, 200, 201], n=2, **GREEDY)
    wait_for(fleet, "kvstore", "llmfleet:kvstore_blocks", 3, tier="ram")
    warmed = scrape_all(fleet)
    results: list[GenerateResult] = []
    for i in range(3):  # through the lease; the 2nd and 3rd hit the prefill worker's cache
        results.append(
            client.generate(token_ids=[*PREFIX, *range(100 + 10 * i, 110 + 10 * i)], **GREEDY)
        )
    first = results[0].completions[0].token_ids
    # The first prompt again, told to stop at its first token: finished_reason "stop", and
    # the prefill worker's answer ends it, so its lease is released rather than committed.
    results.append(
        client.generate(token_ids=[*PREFIX, *range(100, 110)], stop_token_ids=[first[0]], **GREEDY)
    )
    results.append(client.generate(token_ids=[5, 6, 7, 8, 9], **GREEDY))  # short: no lease
    results.append(client.generate("hello metrics", raw=True, **GREEDY))  # tokenized
    # The router ends a request's bookkeeping (and releases a lease, fire-and-forget) just
    # after the last message leaves: let that land before the final scrape.
    wait_for(fleet, "router", "vllm:e2e_request_latency_seconds_count", 2 + len(results))
    [decode] = [c.name for c in fleet.workers if c.role == "decode"]
    wait_for(fleet, decode, "llmfleet:kv_leases_total", 1, state="released")
    after = scrape_all(fleet)
    client.close()
    return warm, results, before, warmed, after


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def workers(fleet: Fleet, role: str) -> list[str]:
    return [c.name for c in fleet.workers if c.role == role]


def all_names(scrapes: Iterable[Samples]) -> set[str]:
    return {n for samples in scrapes for n, _, _ in samples}


ENGINE_NAMES = [  # on every worker, with model_name
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]
REQUEST_NAMES = [  # on the router, with model_name
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
]


def test_named_metrics_are_on_their_services_with_model_name(fleet, traffic):
    *_, after = traffic
    with GenerationClient(fleet.endpoint) as client:
        model_name = client.model_info().model_id
    for w in fleet.workers:
        for name in ENGINE_NAMES:
            assert has(after[w.name], name, model_name=model_name), (w.name, name)
        assert total(after[w.name], "vllm:cache_config_info", block_size=str(BS)) == 1
        assert has(after[w.name], "vllm:cache_config_info", num_gpu_blocks=str(NUM_BLOCKS))
        assert 0.0 <= total(after[w.name], "vllm:kv_cache_usage_perc") <= 1.0
    for name in REQUEST_NAMES:
        assert has(after["router"], name, model_name=model_name), name
    # Idle after the traffic: nothing running or waiting on the workers or the router. The
    # gateway's fleet gauges come from the workers' load reports (a heartbeat old at most), so
    # they read 0 within seconds, not at once.
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    for name in idle:
        assert all(total(s, name) == 0 for n, s in after.items() if n != "gateway"), name
    deadline = time.monotonic() + 15
    while any(total(scrape(fleet.child("gateway")), name) for name in idle):
        assert time.monotonic() < deadline, "the gateway's fleet gauges stayed above 0"
        time.sleep(0.2)


def test_token_counters_equal_the_usage_the_client_got(traffic):
    warm, results, before, _, after = traffic
    usages = [r.usage for r in [warm, *results]]
    worker_names = [n for n in after if n not in ("router", "tokenizer", "kvstore")]

    def summed(name: str) -> float:
        return sum(delta(after[w], before[w], name) for w in worker_names)

    assert summed("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert summed("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    # The prefill worker's cache served the shared prefix to the 2nd, 3rd and 4th long prompt.
    hits = summed("vllm:prefix_cache_hits_total")
    assert len(PREFIX) * 3 <= hits <= summed("vllm:prefix_cache_queries_total")


def test_request_counters_and_histograms_match_the_requests(traffic):
    warm, results, before, warmed, after = traffic
    s0, s1, s = before["router"], warmed["router"], after["router"]
    reasons = Counter(c.finish_reason for r in [warm, *results] for c in r.completions[:1])
    assert reasons == {"length": 6, "stop": 1}
    for reason, count in reasons.items():
        assert delta(s, s0, "vllm:request_success_total", finished_reason=reason) == count
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(s, s1, f"vllm:{hist}_seconds_count") == len(results), hist
        assert delta(s, s1, f"vllm:{hist}_seconds_sum") > 0, hist
    # One inter-token gap per token after the first (single-completion requests).
    gaps = sum(len(r.completions[0].token_ids) - 1 for r in results)
    assert delta(s, s1, "vllm:inter_token_latency_seconds_count") == gaps
    assert delta(s, s0, "llmfleet:migrations_total") == 0


def test_kv_transfer_leases_and_kvstore_metrics_move(fleet, traffic):
    _, _, before, _, after = traffic
    [prefill], [decode] = workers(fleet, "prefill"), workers(fleet, "decode")
    leased = 4  # the long prompts: 58 tokens = 4 blocks each
    pushed = delta(after[prefill], before[prefill], "llmfleet:kv_transfer_bytes_total")
    received = delta(after[decode], before[decode], "llmfleet:kv_transfer_bytes_total")
    assert pushed == received > 0
    assert pushed % (leased * 4) == 0  # every lease moved its 4 whole blocks
    block_bytes = pushed // (leased * 4)
    for worker, direction in ((prefill, "push"), (decode, "receive")):
        name = "llmfleet:kv_transfer_seconds_count"
        assert delta(after[worker], before[worker], name, direction=direction) == leased
    lease_states = {
        state: delta(after[decode], before[decode], "llmfleet:kv_leases_total", state=state)
        for state in ("reserved", "committed", "released", "expired")
    }
    # The "stop" request ended with its first token: its lease was released, not committed.
    assert lease_states == {"reserved": 4, "committed": 3, "released": 1, "expired": 0}
    s = after["router"]
    assert total(s, "llmfleet:lease_outcomes_total", outcome="committed") == 3
    assert total(s, "llmfleet:lease_outcomes_total", outcome="released") == 1
    # Routing: each lease request picks a decode and a prefill worker, the others one worker
    # (three, and the gateway's before the first scrape).
    assert delta(s, before["router"], "llmfleet:routing_decisions_total") == 2 * leased + 3

    kv = after["kvstore"]
    hits = total(kv, "llmfleet:kvstore_hits_total")
    assert hits >= 3  # the shared prefix, fetched by the prefill worker
    assert total(kv, "llmfleet:kvstore_transfer_bytes_total", op="get") == hits * block_bytes
    assert total(kv, "llmfleet:kvstore_transfer_bytes_total", op="put") >= 3 * block_bytes
    blocks = total(kv, "llmfleet:kvstore_blocks", tier="ram")
    assert total(kv, "llmfleet:kvstore_bytes", tier="ram") == blocks * block_bytes > 0
    for name in ("llmfleet:kvstore_bytes", "llmfleet:kvstore_evictions_total"):
        assert has(kv, name, tier="ram") and has(kv, name, tier="disk"), name
    assert has(kv, "llmfleet:kvstore_misses_total")

    tok = after["tokenizer"]
    name = "llmfleet:tokenizer_latency_seconds_count"
    assert delta(tok, before["tokenizer"], name, op="tokenize") == 1  # the one text prompt
    assert total(tok, name, op="detokenize") >= 7  # at least one message per request


def test_estimated_flops_and_bytes_agree_with_the_model_shape(model, fleet, traffic):
    warm, results, before, _, after = traffic
    loaded = load_model(model, dtype=torch.float32, progress=False)
    cache_dtype = next(
        lab["cache_dtype"]
        for n, lab, _ in after[fleet.workers[0].name]
        if n == "vllm:cache_config_info"
    )
    shape = model_shape(loaded.model, kv_bytes=getattr(torch, cache_dtype).itemsize)
    h, L, q = shape.hidden_size, shape.num_layers, shape.num_heads * shape.head_dim
    per_token = L * shape.projection_params + L * 3 * h * shape.intermediate_size
    max_context = len(PREFIX) + 10 + MAX_TOKENS
    for w in fleet.workers:
        b, a = before[w.name], after[w.name]
        labels = {"device": "cpu"}
        flops = delta(a, b, "llmfleet:estimated_flops_total", **labels)
        written = delta(a, b, "llmfleet:estimated_write_bytes_total", **labels)
        read = delta(a, b, "llmfleet:estimated_read_bytes_total", **labels)
        steps = delta(a, b, "llmfleet:engine_step_seconds_count")
        sampled = delta(a, b, "vllm:generation_tokens_total")
        assert flops > 0 and steps > 0, w.name
        # Every computed token writes its K and V once: the count of tokens the engine ran.
        tokens, rest = divmod(written, shape.kv_bytes_per_token)
        assert rest == 0 and tokens >= sampled, w.name
        # FLOPs: matmuls for those tokens, the LM head for each sampled row, and attention
        # that is positive and at most every token attending over the longest context.
        attention = flops - 2 * tokens * per_token - 2 * h * shape.vocab_size * sampled
        assert 0 < attention <= 4 * L * q * tokens * max_context, w.name
        # Each step reads every layer's weights at least once.
        layer_bytes = per_token * shape.weight_bytes
        assert steps * layer_bytes <= read, w.name


def test_the_dashboard_reads_only_scraped_metrics(traffic):
    *_, after = traffic
    scraped = all_names(after.values())
    missing = dashboard_metric_names() - scraped
    assert not missing, sorted(missing)


def test_gateway_counts_its_request(traffic):
    *_, after = traffic
    gw = after["gateway"]
    completions = {"endpoint": "/v1/completions"}
    assert total(gw, "llmfleet:gateway_requests_total", **completions) == 1
    assert total(gw, "llmfleet:gateway_requests_total", **completions, status="200") == 1
    assert total(gw, "llmfleet:gateway_requests_total", endpoint="/health") >= 1  # the launcher
    duration = "llmfleet:gateway_request_duration_seconds_count"
    assert total(gw, duration, endpoint="/v1/completions") == 1


def test_gateway_metrics_port_has_the_fleet_gauges_per_worker(fleet, traffic):
    gw = scrape(fleet.child("gateway"))  # its own metrics port: the same body as its HTTP one
    workers = [c.name for c in fleet.workers]
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        rows = [(lab.get("worker"), v) for n, lab, v in gw if n == name]
        assert rows[0][0] is None, rows  # the fleet's sample first, then each worker's
        assert sorted(w for w, _ in rows[1:]) == sorted(workers), rows
        assert rows[0][1] >= 0 and all(0 <= v <= 1 for _, v in rows[1:] if "kv_" in name)
    running = [v for n, lab, v in gw if n == "vllm:num_requests_running"]
    assert running[0] == sum(running[1:])
