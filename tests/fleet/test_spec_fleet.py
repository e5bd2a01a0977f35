"""Speculative decoding through a real disaggregated fleet: the decode worker drafts with
n-gram lookup and verifies, the prefill worker never drafts; greedy text equals the
non-speculative engine's (and the same fleet's with `speculative=False`), token for token; the
draft counts reach the client's usage (gRPC and the OpenAI gateway) and the decode worker's
/metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from fleet_helpers import WORKER_ARGS, reference_tokens
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from llmfleet.cli.fleet_plan import Child, FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative_settings import SpeculativeSettings
from llmfleet.text.detokenizer import IncrementalDetokenizer

SHORT = 16  # prompts shorter than this are prefilled by the decode worker itself
MAX_TOKENS = 24
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(make_checkpoint_module) -> str:
    return str(make_checkpoint_module("qwen2", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def fleet(model):
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=model,
        kvstore=False,
        speculative=SpeculativeSettings(
            speculative_method="ngram",
            num_speculative_tokens=4,
            speculative_disable_batch_size="never",
        ),
        extra_args={"worker": WORKER_ARGS, "router": ["--short-prompt-threshold", str(SHORT)]},
        gateway=True,
        http_port=0,
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return GenerationClient(fleet.endpoint)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, 250, (8,), generator=g).tolist()
    return [
        motif * 6,  # repeated text: the lookup finds what follows, drafts get accepted
        torch.randint(3, 250, (40,), generator=g).tolist(),
        (motif[:5] + torch.randint(3, 250, (3,), generator=g).tolist()) * 5,
        motif[:6] * 2,  # short: the decode worker prefills it itself
    ]


def scrape(child: Child, name: str) -> float:
    with urllib.request.urlopen(child.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def worker(fleet: Fleet, role: str) -> Child:
    return next(c for c in fleet.workers if c.role == role)


def test_greedy_with_speculation_equals_without(model, client, fleet):
    ps = prompts()
    ref = reference_tokens(model, ps, SamplingParams(**GREEDY))
    drafted = accepted = 0
    for i, p in enumerate(ps):
        deltas = list(client.stream(token_ids=p, **GREEDY))
        tokens = [t for d in deltas for t in d.token_ids]
        text = "".join(d.text for d in deltas)
        assert tokens == ref[i][0], i
        plain = client.generate(token_ids=p, speculative=False, **GREEDY)
        assert plain.completions[0].token_ids == tokens, i
        assert plain.completions[0].text == text, i
        assert plain.usage.num_draft_tokens == plain.usage.num_accepted_tokens == 0
        res = client.generate(token_ids=p, **GREEDY)
        assert res.completions[0].token_ids == tokens, i
        assert 0 <= res.usage.num_accepted_tokens <= res.usage.num_draft_tokens
        drafted += res.usage.num_draft_tokens
        accepted += res.usage.num_accepted_tokens
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    # The decode worker speculated; the prefill worker never drafted a token.
    decode, prefill = worker(fleet, "decode"), worker(fleet, "prefill")
    assert scrape(decode, "llmfleet:spec_decode_num_accepted_tokens_total") >= accepted
    assert scrape(decode, "llmfleet:spec_decode_num_draft_tokens_total") >= drafted
    drafts = scrape(decode, "llmfleet:spec_decode_num_drafts_total")
    assert drafts > 0 and scrape(decode, "llmfleet:spec_decode_num_steps_total") > 0
    assert scrape(decode, "llmfleet:spec_decode_num_emitted_tokens_total") > drafts
    assert scrape(decode, "llmfleet:spec_decode_mean_accepted_length") > 1.0
    assert scrape(decode, "llmfleet:spec_decode_disable_batch_size") == 0  # never turned off
    assert scrape(decode, "llmfleet:spec_decode_num_accepted_tokens_per_pos_total") >= accepted
    assert scrape(prefill, "llmfleet:spec_decode_num_draft_tokens_total") == 0


def test_n2_with_speculation(model, client):
    p = prompts()[0]
    params = SamplingParams(n=2, **GREEDY)
    ref = reference_tokens(model, [p], params)
    res = client.generate(token_ids=p, n=2, **GREEDY)
    assert [c.token_ids for c in res.completions] == [ref[0][0], ref[0][1]]
    assert res.usage.num_draft_tokens > 0


def post(fleet: Fleet, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{fleet.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_gateway_takes_the_speculative_field_and_reports_drafts(client, fleet):
    body = {
        "model": client.model_info().model_id,
        "prompt": "one two three four " * 6,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    on = post(fleet, "/v1/completions", body)
    off = post(fleet, "/v1/completions", {**body, "speculative": False})
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert "completion_tokens_details" not in off["usage"]
    details = on["usage"]["completion_tokens_details"]
    assert 0 <= details["num_accepted_tokens"] <= details["num_draft_tokens"]
    assert details["num_draft_tokens"] > 0
    chat = {
        "model": body["model"],
        "messages": [{"role": "user", "content": body["prompt"]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    chat_on = post(fleet, "/v1/chat/completions", chat)
    chat_off = post(fleet, "/v1/chat/completions", {**chat, "speculative": False})
    texts = [c["choices"][0]["message"]["content"] for c in (chat_on, chat_off)]
    assert texts[0] == texts[1]
    assert "completion_tokens_details" not in chat_off["usage"]
    bad = urllib.request.Request(
        f"{fleet.http_url}/v1/completions",
        data=json.dumps({**body, "speculative": "sometimes"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(bad, timeout=60)
    assert exc.value.code == 400
    assert "speculative" in exc.value.read().decode()


def test_a_worker_with_bad_speculative_flags_exits_2_naming_the_flag(model):
    argv = [sys.executable, "-m", "llmfleet.services.worker", "--model", model]
    argv += ["--speculative-method", "ngram", "--ngram-min", "5", "--ngram-max", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--ngram-max" in proc.stderr


def test_a_stop_string_ends_a_drafted_completion_at_its_token(model, client):
    """A verified step brings several tokens; when a stop string completes at one of them but
    the last, the completion ends there: the same tokens, text and token count as without
    drafts, the tokens after it dropped."""
    p = prompts()[0]
    tokens = reference_tokens(model, [p], SamplingParams(**GREEDY))[0][0]
    detok = IncrementalDetokenizer(AutoTokenizer.from_pretrained(model), p)
    texts = [detok.add_tokens([t]) for t in tokens]  # each token's text
    firsts, at = [], 0  # the first token of each delta of several (accepted drafts)
    for d in client.stream(token_ids=p, **GREEDY):
        if len(d.token_ids) > 1:
            firsts.append(at)
        at += len(d.token_ids)
    first = next(i for i in firsts if texts[i])
    upto = "".join(texts[: first + 1])
    stop = next(upto[-n:] for n in range(1, len(upto) + 1) if upto.find(upto[-n:]) == len(upto) - n)
    runs = []
    for speculative in (False, True):
        deltas = list(client.stream(token_ids=p, stop=[stop], speculative=speculative, **GREEDY))
        res = client.generate(token_ids=p, stop=[stop], speculative=speculative, **GREEDY)
        c = res.completions[0]
        assert [t for d in deltas for t in d.token_ids] == c.token_ids
        assert res.usage.completion_tokens == len(c.token_ids) == first + 1
        assert c.text == upto[: -len(stop)] and c.finish_reason == "stop"
        runs.append((c.token_ids, c.text))
    assert runs[0] == runs[1]
