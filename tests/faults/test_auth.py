"""API keys at the public doors and per-tenant prefix caches, on a real fleet (router, tokenizer,
one simulated worker, the HTTP gateway) started with keys: callers without a valid key get 401
(HTTP) or UNAUTHENTICATED (gRPC), health stays open, and two tenants sending the same prompt
never see each other's cached prompt tokens while one tenant's repeats do."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.main import main as llmfleet_main
from llmfleet.client.generation import ClientError, GenerationClient
from llmfleet.shared.core.api_keys import KeyRing, tenant_salt
from llmfleet.shared.core.config import AuthConfig, from_env
from llmfleet.shared.core.errors import ValidationError

ALICE, ALICE_ROTATED, BOB = "sk-alice-1", "sk-alice-2", "sk-bob"
KEYS = f"alice:{ALICE},alice:{ALICE_ROTATED},{BOB}"  # bob's tenant is derived from his key
SIMULATED = {"simulate": True, "sim_step_ms": 1.0, "sim_decode_ms_per_seq": 0.01}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    spec = FleetSpec(
        port=0,
        workers=1,
        engine=SIMULATED,
        kvstore=False,
        gateway=True,
        http_port=0,
        env={"LLMFLEET_API_KEYS": KEYS},
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


def oai(fleet: Fleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.http_url}/v1", api_key=key, max_retries=0, timeout=60)


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {}


# ---- HTTP (gateway) -------------------------------------------------------------------------


def test_openai_client_without_a_valid_key_gets_401(fleet):
    with pytest.raises(openai.AuthenticationError) as err:
        oai(fleet, "sk-wrong").completions.create(model="m", prompt="Hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        oai(fleet, "sk-wrong").models.list()
    status, body = http_get(f"{fleet.http_url}/v1/models")  # no Authorization at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_key_gets_answers(fleet):
    client = oai(fleet, ALICE)
    [card] = client.models.list().data
    res = client.completions.create(
        model=card.id, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert res.usage.completion_tokens == 4 and res.choices[0].finish_reason == "length"
    status, body = http_get(f"{fleet.http_url}/v1/models", {"x-api-key": BOB})  # Anthropic's
    assert status == 200 and body["data"][0]["id"] == card.id


def test_health_and_metrics_stay_open(fleet):
    status, body = http_get(f"{fleet.http_url}/health")
    assert status == 200 and body["status"] == "ok"
    with urllib.request.urlopen(f"{fleet.http_url}/metrics", timeout=30) as resp:
        assert resp.status == 200
    with grpc.insecure_channel(fleet.endpoint) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="llmfleet.v1.Generation"), timeout=10
        )
    assert check.status == health_pb2.HealthCheckResponse.SERVING


# ---- gRPC (router) --------------------------------------------------------------------------


def test_grpc_without_a_valid_key_is_unauthenticated(fleet):
    for key in (None, "sk-wrong"):
        with GenerationClient(fleet.endpoint, api_key=key) as client:
            with pytest.raises(ClientError) as err:
                client.generate(token_ids=[1, 2, 3], max_tokens=2)
            assert err.value.code_name == "UNAUTHENTICATED"
            with pytest.raises(ClientError) as err:
                client.model_info()
            assert err.value.code_name == "UNAUTHENTICATED"


def test_grpc_with_a_key_gets_tokens(fleet):
    with GenerationClient(fleet.endpoint, api_key=BOB) as client:
        res = client.generate(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True)
        assert len(res.completions[0].token_ids) == 3
        assert client.model_info().block_size > 0
    with GenerationClient(fleet.endpoint) as client:  # a per-call key over the client's none
        res = client.generate(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True, api_key=ALICE)
        assert len(res.completions[0].token_ids) == 2


def test_cli_sends_its_key(fleet, monkeypatch, capsys):
    argv = ["generate", "--endpoint", fleet.endpoint, "--max-tokens", "2", "--raw", "Hello"]
    monkeypatch.delenv("LLMFLEET_API_KEY", raising=False)
    assert llmfleet_main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert llmfleet_main([*argv[:1], "--api-key", BOB, *argv[1:]]) == 0
    monkeypatch.setenv("LLMFLEET_API_KEY", ALICE)
    assert llmfleet_main(argv) == 0


# ---- per-tenant prefix caches ---------------------------------------------------------------


def test_tenants_never_share_cached_prompt_tokens(fleet):
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 12

    def cached(key: str) -> int:
        client = oai(fleet, key)
        model = client.models.list().data[0].id
        res = client.completions.create(model=model, prompt=prompt, max_tokens=1)
        assert res.usage.prompt_tokens > 64
        return res.usage.prompt_tokens_details.cached_tokens

    assert cached(ALICE) == 0
    assert cached(BOB) == 0  # alice's blocks are not bob's
    assert cached(ALICE) > 0  # ... while alice's repeat hits her own
    assert cached(ALICE_ROTATED) > 0  # another key of tenant alice shares her cache
    assert cached(BOB) > 0


def test_a_client_salt_cannot_reach_another_tenants_cache(fleet):
    ids = [7] + [(i * 37) % 5000 + 10 for i in range(96)] + [uuid.uuid4().int % 1000 + 9000]
    ids.reverse()  # the unique token first: no earlier request shares a block
    with GenerationClient(fleet.endpoint, api_key=ALICE) as alice:
        assert alice.generate(token_ids=ids, max_tokens=1).usage.cached_prompt_tokens == 0
        assert alice.generate(token_ids=ids, max_tokens=1).usage.cached_prompt_tokens > 0
    with GenerationClient(fleet.endpoint, api_key=BOB) as bob:
        # alice's salt as the router derives it, sent by bob as his own: still bob's cache
        forged = tenant_salt("alice", "")
        res = bob.generate(token_ids=ids, max_tokens=1, cache_salt=forged)
        assert res.usage.cached_prompt_tokens == 0


def test_only_the_owning_tenant_can_abort_a_request(fleet):
    rid = f"guessable-{uuid.uuid4().hex[:6]}"
    with (
        GenerationClient(fleet.endpoint, api_key=ALICE) as alice,
        GenerationClient(fleet.endpoint, api_key=BOB) as bob,
    ):
        stream = alice.stream(token_ids=[1, 2, 3], max_tokens=4000, ignore_eos=True, request_id=rid)
        deltas = iter(stream)
        next(deltas)  # running
        assert bob.abort(rid) is False  # bob cannot see, nor stop, alice's request
        assert alice.abort(rid) is True
        finish = [d.finish_reason for d in deltas if d.finish_reason][-1]
    assert finish == "abort" and len(stream.result.completions[0].token_ids) < 4000


# ---- key configuration ----------------------------------------------------------------------


def test_key_entries_name_or_derive_their_tenant():
    ring = from_env(AuthConfig, {"LLMFLEET_API_KEYS": f" {KEYS} , "}).keyring
    assert ring.tenant_of(ALICE) == ring.tenant_of(ALICE_ROTATED) == "alice"
    assert ring.tenant_of(BOB).startswith("key-") and ring.tenant_of(BOB) != "alice"
    assert ring.tenant_of("sk-alice") is None and ring.tenant_of(None) is None
    assert ALICE not in repr(ring) and BOB not in repr(AuthConfig(api_keys=[BOB]))
    assert not KeyRing.parse([]).enabled and KeyRing.parse([]).tenant_of(BOB) is None
    for bad in (["alice:"], [":sk"], ["sk-a", "bob:sk-a"], ["sk with space"]):
        with pytest.raises(ValidationError) as err:
            AuthConfig(api_keys=bad)
        assert err.value.field == "api_keys" and "sk" not in err.value.message


def test_services_and_up_take_repeated_api_key_flags(capsys):
    from llmfleet.services.gateway.__main__ import SERVICE as GATEWAY
    from llmfleet.services.router.__main__ import SERVICE as ROUTER

    for service in (ROUTER, GATEWAY):
        _, auth = service.parse(["--api-key", f"alice:{ALICE}", "--api-key", BOB])
        assert auth.keyring.tenant_of(ALICE) == "alice" and auth.keyring.tenant_of(BOB)
    assert llmfleet_main(["up", "--api-key", "alice:", "--port", "0"]) == 2  # nothing started
    err = capsys.readouterr().err
    assert "api_keys" in err and "alice" not in err
