"""The official `openai` client against a real fleet behind the gateway, started by `llmfleet up`
(one unified worker on a tiny random checkpoint). Greedy outputs through HTTP must equal the
gRPC client's; cancellation is checked on the worker's own stats."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx2
import openai
import pytest
from gateway_helpers import a_stop_string, llmfleet_up, wait_workers_idle
from prometheus_client.parser import text_string_to_metric_families

from llmfleet.client.generation import GenerationClient

MAX_QUEUED = 3  # the router's admission limit in this fleet: the 4th concurrent request is 429
LONG = 32000  # tokens: minutes of decoding on a CPU, far longer than any wait below


@pytest.fixture(scope="module")
def up(make_checkpoint_module, tmp_path_factory):
    model = str(make_checkpoint_module("llama", max_position_embeddings=32768))
    env = {
        "LLMFLEET_ROUTER_MAX_QUEUED_REQUESTS": str(MAX_QUEUED),
        "LLMFLEET_NUM_KV_BLOCKS": "2100",  # one LONG request fits,
    }
    with llmfleet_up(model, tmp_path_factory.mktemp("logs"), env) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def grpc_client(up):
    with GenerationClient(up.endpoint) as client:
        yield client


@pytest.fixture(scope="module")
def oai(up):
    return openai.OpenAI(base_url=up.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(grpc_client):
    return grpc_client.model_info().model_id


MESSAGES = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_lists_what_the_scheduler_serves(oai, model):
    [card] = oai.models.list().data
    assert card.id == model and card.object == "model" and card.created > 0
    assert oai.models.retrieve(model).id == model


def test_chat_greedy_equals_grpc_streaming_and_not(oai, grpc_client, model):
    ref = grpc_client.generate(messages=MESSAGES, max_tokens=12, temperature=0, ignore_eos=True)
    res = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, **GREEDY)
    [choice] = res.choices
    assert choice.message.content == ref.completions[0].text
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert res.object == "chat.completion" and res.model == model
    assert res.id.startswith("chatcmpl-") and res.created > 0
    assert res.usage.prompt_tokens == ref.usage.prompt_tokens
    assert res.usage.completion_tokens == 12
    assert res.usage.total_tokens == ref.usage.prompt_tokens + 12

    chunks = list(
        oai.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.completions[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_of_text_and_token_ids_equal_grpc(oai, grpc_client, model):
    ref = grpc_client.generate("Once upon", raw=True, max_tokens=10, temperature=0, ignore_eos=True)
    res = oai.completions.create(model=model, prompt="Once upon", max_tokens=10, **GREEDY)
    assert res.choices[0].text == ref.completions[0].text
    assert res.object == "text_completion" and res.id.startswith("cmpl-")

    ids = [40, 41, 42, 43, 44]
    ref = grpc_client.generate(token_ids=ids, max_tokens=10, temperature=0, ignore_eos=True)
    stream = oai.completions.create(model=model, prompt=ids, max_tokens=10, stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.completions[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_returns_two_choices_streaming_and_not(oai, grpc_client, model):
    ref = grpc_client.generate(messages=MESSAGES, max_tokens=8, temperature=0, ignore_eos=True)
    text = ref.completions[0].text
    res = oai.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=8, **GREEDY)
    assert sorted(c.index for c in res.choices) == [0, 1]
    assert [c.message.content for c in res.choices] == [text, text]
    assert res.usage.completion_tokens == 16

    by_index: dict[int, str] = {0: "", 1: ""}
    stream = oai.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=8, stream=True, **GREEDY
    )
    for chunk in stream:
        for c in chunk.choices:
            by_index[c.index] += c.delta.content or ""
    assert by_index == {0: text, 1: text}


def test_stop_strings_end_the_text_before_them(oai, grpc_client, model):
    full = grpc_client.generate("stop", raw=True, max_tokens=32, temperature=0, ignore_eos=True)
    text = full.completions[0].text
    stop = a_stop_string(text)
    res = oai.completions.create(model=model, prompt="stop", max_tokens=32, stop=[stop], **GREEDY)
    assert res.choices[0].text == text[: text.index(stop)]
    assert res.choices[0].finish_reason == "stop"

    chat = grpc_client.generate(messages=MESSAGES, max_tokens=32, temperature=0, ignore_eos=True)
    text = chat.completions[0].text
    stop = a_stop_string(text)
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=32, stop=stop, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_chat_and_completions(oai, grpc_client, model):
    ref = grpc_client.generate(
        messages=MESSAGES, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3
    )
    res = oai.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = res.choices[0].logprobs.content
    assert len(content) == 6
    for entry, expected in zip(content, ref.completions[0].logprobs, strict=True):
        assert entry.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert len(entry.bytes) == 1  # this vocabulary: one byte per generated token

    res = oai.completions.create(
        model=model, prompt="Once upon", max_tokens=6, logprobs=2, **GREEDY
    )
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and len(top) <= 3


def test_usage_in_stream_with_cached_prefix(oai, model):
    ids = list(range(60, 100))  # 40 tokens: two full KV blocks of 16
    usages = []
    for _ in range(2):
        chunks = list(
            oai.completions.create(
                model=model, prompt=ids, max_tokens=5, stream=True,
                stream_options={"include_usage": True}, **GREEDY,
            )
        )  # fmt: skip
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == []
        usages.append(chunks[-1].usage)
    for u in usages:
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (40, 5, 45)
    assert usages[1].prompt_tokens_details.cached_tokens == 32  # the repeat hit the prefix cache


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"n": 1000}, "n"),
        ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
    ],
)
def test_invalid_sampling_is_400_naming_the_parameter(oai, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=MESSAGES, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.type == "invalid_request_error" and param in e.value.message


def test_invalid_prompts_and_messages_are_400(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[1, 10**6])  # outside the vocabulary
    assert e.value.param == "prompt"
    bad = [{"role": "wizard", "content": "hi"}]
    for extra in ({}, {"max_tokens": 4}):  # checked by the gateway, or by the tokenizer service
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=bad, **extra)
        assert e.value.param == "messages[0].role"


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x", stream=True)


def test_overload_is_429_and_closed_streams_free_the_fleet(oai, up, model):
    streams = [
        oai.completions.create(model=model, prompt=[50 + i] * 8, max_tokens=LONG, stream=True,
                               **GREEDY)
        for i in range(MAX_QUEUED)
    ]  # fmt: skip
    for s in streams:
        next(iter(s))  # each is generating
    [load] = wait_workers_idle(up.worker_addresses, timeout_s=0)
    assert load.num_running == MAX_QUEUED
    with pytest.raises(openai.RateLimitError) as e:
        oai.completions.create(model=model, prompt="one too many", max_tokens=4)
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    for s in streams:
        s.close()  # the HTTP client disconnects mid-stream
    [load] = wait_workers_idle(up.worker_addresses, timeout_s=10)
    assert load.num_running == 0 and load.num_waiting == 0
    assert load.num_free_blocks == load.num_total_blocks


def test_disconnect_cancels_a_non_streaming_request(up, model):
    host, port = up.base_url.removeprefix("http://").split("/")[0].split(":")
    body = json.dumps(
        {
            "model": model,
            "prompt": [7, 8, 9],
            "max_tokens": LONG,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while wait_workers_idle(up.worker_addresses, timeout_s=0)[0].num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    [load] = wait_workers_idle(up.worker_addresses, timeout_s=10)
    assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks
    metrics = httpx2.get(up.base_url.removesuffix("/v1") + "/metrics").text
    assert 'llmfleet:gateway_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics


GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def gie_gauges(url: str) -> dict[str, list[tuple[str | None, float]]]:
    """The GIE gauges at `url`: per name, (worker label or None, value) in exposition order."""
    text = httpx2.get(url, timeout=10).text
    return {
        family.name: [(s.labels.get("worker"), s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
        if family.name in GIE_GAUGES
    }


def running_now(url: str, expected: int, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll the gauges until the fleet's running count is `expected` (heartbeats carry it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = gie_gauges(url)
        if gauges["vllm:num_requests_running"][0][1] == expected:
            return gauges
        assert time.monotonic() < deadline, f"running never {expected}: {gauges}"
        time.sleep(0.1)


def test_printed_metrics_urls_answer_and_the_gateways_has_the_gie_gauges(oai, up, model):
    assert list(up.metrics_urls) == ["tokenizer", "router", "worker-0", "gateway"]
    assert up.metrics_urls["gateway"] == up.base_url.removesuffix("/v1") + "/metrics"
    worker = httpx2.get(up.metrics_urls["worker-0"], timeout=10)
    assert worker.status_code == 200 and "vllm:kv_cache_usage_perc" in worker.text
    assert httpx2.get(up.metrics_urls["router"], timeout=10).status_code == 200
    url = up.metrics_urls["gateway"]

    idle = running_now(url, 0)
    for name in GIE_GAUGES:  # the fleet's sample first (what GIE reads), then the worker's
        assert [w for w, _ in idle[name]] == [None, "worker-0"], idle
        assert idle[name][0][1] == idle[name][1][1] == 0.0  # one worker: total == its own
    streams = [
        oai.completions.create(model=model, prompt=[60 + i] * 40, max_tokens=LONG, stream=True,
                               **GREEDY)
        for i in range(2)
    ]  # fmt: skip
    for s in streams:
        next(iter(s))  # each is generating
    busy = running_now(url, 2)
    assert busy["vllm:num_requests_running"] == [(None, 2.0), ("worker-0", 2.0)]
    assert busy["vllm:num_requests_waiting"] == [(None, 0.0), ("worker-0", 0.0)]
    [(_, used), (_, used_w0)] = busy["vllm:kv_cache_usage_perc"]
    assert 0.0 < used == used_w0 < 0.5  # two 40-token prompts' blocks of 2100
    for s in streams:
        s.close()
    after = running_now(url, 0)
    assert after["vllm:kv_cache_usage_perc"][0][1] < used
