"""Speculative decoding through the Anthropic Messages API and the Responses API, with the
official SDKs, against `llmfleet up` on a tiny model whose worker drafts with n-gram lookup:
the `speculative` body field turns drafting off per request without changing greedy text, the
Responses usage reports the draft counts, a non-boolean is a 400 naming the field; and the
worker's GetWorkerStats shows its method, k, the resolved "auto" threshold and its counts."""

from __future__ import annotations

import anthropic
import grpc
import openai
import pytest
from gateway_helpers import llmfleet_up

from llmfleet.engine.spec_decode import threshold
from llmfleet.v1 import worker_pb2, worker_pb2_grpc

K = 3
MAX_TOKENS = 24
TEXT = "one two three four " * 6
SPECULATION = {"LLMFLEET_SPECULATIVE_METHOD": "ngram", "LLMFLEET_NUM_SPECULATIVE_TOKENS": str(K)}


@pytest.fixture(scope="module")
def fleet(make_checkpoint_module, tmp_path_factory):
    model = str(make_checkpoint_module("qwen2", max_position_embeddings=2048))
    with llmfleet_up(model, tmp_path_factory.mktemp("spec-logs"), SPECULATION) as f:
        yield f


@pytest.fixture(scope="module")
def oai(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def claude(fleet) -> anthropic.Anthropic:
    base = fleet.base_url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


def worker_stats(fleet) -> worker_pb2.GetWorkerStatsResponse:
    [address] = fleet.worker_addresses
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(), timeout=10
        )


def test_anthropic_messages_take_the_speculative_field(claude, model, fleet):
    before = worker_stats(fleet).spec_decode.num_draft_tokens
    messages = [{"role": "user", "content": TEXT}]

    def create(speculative):
        body = {"temperature": 0.0, "speculative": speculative}
        msg = claude.messages.create(
            model=model, max_tokens=MAX_TOKENS, messages=messages, extra_body=body
        )
        [block] = msg.content
        return block.text, msg.usage

    off, off_usage = create(False)
    after_off = worker_stats(fleet).spec_decode.num_draft_tokens
    assert after_off == before  # nothing drafted for it
    on, on_usage = create(True)
    assert on == off and on_usage.output_tokens == off_usage.output_tokens > 1
    assert not hasattr(off_usage, "num_draft_tokens")
    assert on_usage.num_draft_tokens > 0  # our extra beside Anthropic's counts
    assert 0 <= on_usage.num_accepted_tokens <= on_usage.num_draft_tokens
    assert worker_stats(fleet).spec_decode.num_draft_tokens > after_off
    with claude.messages.stream(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=messages,
        extra_body={"temperature": 0.0, "speculative": True},
    ) as stream:
        assert "".join(stream.text_stream) == on
    for bad in ("yes", 1):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model=model,
                max_tokens=MAX_TOKENS,
                messages=messages,
                extra_body={"speculative": bad},
            )
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith("speculative:")


def test_responses_take_the_speculative_field_and_report_drafts(oai, model):
    def create(**extra):
        return oai.responses.create(
            model=model,
            input=TEXT,
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, **extra},
        )

    off, on, default = create(speculative=False), create(speculative=True), create()
    assert on.output_text == off.output_text == default.output_text
    assert on.usage.output_tokens == off.usage.output_tokens == MAX_TOKENS
    assert not hasattr(off.usage.output_tokens_details, "num_draft_tokens")
    for res in (on, default):  # unset follows the worker, which speculates
        details = res.usage.output_tokens_details
        assert details.num_draft_tokens > 0
        assert 0 <= details.num_accepted_tokens <= details.num_draft_tokens
    with pytest.raises(openai.BadRequestError) as e:
        create(speculative="sometimes")
    assert e.value.body["param"] == "speculative"


def test_worker_stats_show_the_speculation(fleet, oai, model):
    oai.completions.create(
        model=model,
        prompt=TEXT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    resp = worker_stats(fleet)
    assert resp.HasField("spec_decode")
    spec = resp.spec_decode
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", K)
    assert spec.disable_batch_size == threshold.resolve("cpu", "ngram", K)[0] >= 1  # "auto"
    assert spec.num_steps > 0 and spec.num_draft_tokens > 0
    assert 0 <= spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.num_emitted_tokens > spec.num_accepted_tokens


def test_chat_and_completions_take_only_a_json_boolean(oai, model):
    for bad in (1, "true"):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": TEXT}],
                max_tokens=2,
                extra_body={"speculative": bad},
            )
        assert e.value.body["param"] == "speculative"
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(
                model=model, prompt=TEXT, max_tokens=2, extra_body={"speculative": bad}
            )
        assert e.value.body["param"] == "speculative"
