"""The gateway's HTTP surface without a fleet: its router address answers nothing, so every
generation is a 503, while malformed bodies, unknown routes, health and metrics are answered by
the gateway itself."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest
from gateway_helpers import gateway_in_thread
from tiny_models import make_tokenizer

from llmfleet.cli.fleet_plan import pick_free_ports
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.upstream import Upstream
from llmfleet.shared.core.config import GatewayConfig
from llmfleet.shared.core.model_info import ModelInfo


@pytest.fixture(scope="module")
def base_url():
    [nobody] = pick_free_ports(1)
    config = GatewayConfig(port=0, router_address=f"127.0.0.1:{nobody}")
    with gateway_in_thread(config, make_tokenizer()) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_unreachable_scheduler_is_503_for_every_model_route(oai, base_url):
    with pytest.raises(openai.InternalServerError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503
    assert e.value.code == "service_unavailable" and "cannot serve" in e.value.message
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(model="m", prompt="hi", stream=True)
    assert e.value.status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        oai.models.list()
    assert e.value.status_code == 503
    health = httpx2.get(base_url.removesuffix("/v1") + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/chat/completions", {"model": "m"}, "messages"),
        ("/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ("/completions", {"model": "m", "prompt": "x", "n": "two"}, "n"),
        ("/completions", {"model": "m", "prompt": {"a": 1}}, "prompt"),
        ("/completions", {"prompt": "x"}, "model"),
    ],
)
def test_malformed_bodies_are_400_in_openai_shape_naming_the_field(base_url, path, body, param):
    resp = httpx2.post(base_url + path, json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_invalid_json_and_unknown_routes_answer_in_openai_shape(base_url):
    resp = httpx2.post(
        base_url + "/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    resp = httpx2.get(base_url + "/no/such/route")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_metrics_count_requests_by_route_and_status(base_url, oai):
    with pytest.raises(openai.InternalServerError):
        oai.completions.create(model="m", prompt="hi")
    text = httpx2.get(base_url.removesuffix("/v1") + "/metrics").text
    line = 'llmfleet:gateway_requests_total{endpoint="/v1/completions",status="503"}'
    assert line in text
    count = float(text.split(line, 1)[1].split()[0])
    assert count >= 1


def test_served_model_name_renames_the_model():
    info = ModelInfo("org/model", "LlamaForCausalLM", 260, 2048, [256], 16, 20, 16)

    class Router:  # GetModelInfo only
        async def model_info(self, timeout=None):
            return info

        async def close(self):
            pass

    async def check():
        up = Upstream(GatewayConfig(served_model_name="alias"), make_tokenizer())
        await up.client.close()
        up.client = Router()
        served = await up.require("alias")
        assert (served.name, served.info.model_id) == ("alias", "org/model")
        with pytest.raises(APIError) as e:
            await up.require("org/model")
        assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")

    asyncio.run(check())


def test_the_session_header_or_the_user_field_reaches_the_router(base_url, monkeypatch):
    """X-Session-ID names the conversation for routing; without it, the body's `user`."""
    from llmfleet.client.generation import AsyncGenerationClient
    from llmfleet.services.gateway.upstream import ServedModel
    from llmfleet.shared.core.errors import ValidationError

    info = ModelInfo("m", "LlamaForCausalLM", 260, 2048, (256,), 16, 20, 16)
    sent: list[str] = []

    async def require(self, requested):
        return ServedModel("m", info, 0)

    def stream(self, prompt=None, *, timeout=None, **kwargs):
        sent.append(kwargs["session_id"])
        raise ValidationError("prompt", "recorded")  # a 400: the call goes no further

    monkeypatch.setattr(Upstream, "require", require)
    monkeypatch.setattr(AsyncGenerationClient, "stream", stream)
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "user": "alice"}
    for headers in ({"X-Session-ID": "conversation-7"}, {}):
        resp = httpx2.post(f"{base_url}/completions", json=body, headers=headers)
        assert resp.status_code == 400
    assert sent == ["conversation-7", "alice"]
