"""The official `anthropic` SDK's Messages API against a fleet started by `llmfleet up` on the
bundled model: plain and streamed messages, system prompts, stop sequences, a forced tool,
token counting, and errors in Anthropic's shape; then API keys (the SDK sends `x-api-key`) on a
gateway without a fleet. Greedy outputs must equal the chat completion of the same
conversation."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from gateway_helpers import a_stop_string, gateway_in_thread
from tiny_models import make_tokenizer

from llmfleet.cli.fleet_plan import pick_free_ports
from llmfleet.shared.core.config import AuthConfig, GatewayConfig

KEY = "sk-anthropic-test"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}]
# The SDK has no sampling arguments of its own any more: they go in the body.
GREEDY = {"extra_body": {"temperature": 0.0}}
QUESTION = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(bundled_fleet):  # `oai` and `model`: conftest.py's, on the same fleet
    base = bundled_fleet.base_url.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)


def _chat(oai, model, messages, max_tokens, **extra):
    res = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, **extra
    )
    return res.choices[0]


@pytest.fixture(scope="module")
def greedy_ref(oai, model):
    """The chat completion of QUESTION, greedy, 8 tokens at most."""
    return _chat(oai, model, QUESTION, 8)


def test_plain_and_streamed_messages_equal_greedy_chat(client, greedy_ref, model):
    ref = greedy_ref
    msg = client.messages.create(model=model, max_tokens=8, messages=QUESTION, **GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    [block] = msg.content
    assert block.type == "text" and block.text == ref.message.content
    assert msg.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert msg.stop_sequence is None and msg.usage.output_tokens <= 8

    raw = list(
        client.messages.create(model=model, max_tokens=8, messages=QUESTION, stream=True, **GREEDY)
    )
    kinds = [e.type for e in raw]
    num_deltas = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * num_deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # (the SDK drops `ping`)
    assert raw[0].message.usage.input_tokens == msg.usage.input_tokens
    assert raw[-2].delta.stop_reason == msg.stop_reason
    assert raw[-2].usage.output_tokens == msg.usage.output_tokens

    with client.messages.stream(model=model, max_tokens=8, messages=QUESTION, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == block.text and final.content[0].text == block.text
    assert final.usage.input_tokens == msg.usage.input_tokens
    assert client.messages.count_tokens(model=model, messages=QUESTION).input_tokens == (
        msg.usage.input_tokens
    )


def test_system_prompt_blocks_are_a_system_message(client, oai, model):
    system = "You are a pirate. Answer like one."
    ref = _chat(oai, model, [{"role": "system", "content": system}, *QUESTION], 6)
    msg = client.messages.create(
        model=model,
        max_tokens=6,
        system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}],
        **GREEDY,
    )
    assert msg.content[0].text == ref.message.content


def test_stop_sequences_set_the_stop_reason(client, greedy_ref, model):
    ref = greedy_ref.message.content
    stop = a_stop_string(ref)
    msg = client.messages.create(
        model=model, max_tokens=8, messages=QUESTION, stop_sequences=[stop], **GREEDY
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == ref[: ref.index(stop)]


def test_tool_choice_any_returns_a_tool_use_whose_input_validates(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(
        model=model, max_tokens=32, messages=ask, tools=TOOLS, tool_choice={"type": "any"}, **GREEDY
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and msg.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)

    # The tool's result goes back in a user turn; the model answers in text.
    follow = client.messages.create(
        model=model,
        max_tokens=4,
        messages=[
            *ask,
            {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}
                ],
            },
        ],
        tools=TOOLS,
        tool_choice={"type": "none"},
        **GREEDY,
    )
    assert follow.content[0].type == "text" and follow.usage.output_tokens >= 1
    assert follow.usage.input_tokens > msg.usage.input_tokens


def test_a_named_tool_streams_its_input_as_json_deltas(client, model):
    with client.messages.stream(
        model=model,
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    [use] = final.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)


def test_an_output_format_schema_returns_json_that_validates(client, model):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=model,
        max_tokens=16,
        messages=[{"role": "user", "content": "Pick a color."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    assert msg.stop_reason == "end_turn"


def test_errors_are_in_anthropics_shape(client, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, messages=QUESTION, max_tokens=anthropic.omit)
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert e.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model `no-such-model` does not exist.",
        },
    }

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert (
        "messages[0].content[0].source.data: the image is empty" in e.value.body["error"]["message"]
    )
    # A well-formed image, for a text-only model: refused by the tokenizer service.
    gif = "R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7"  # a 1x1 GIF
    image["source"] = {"type": "base64", "media_type": "image/gif", "data": gif}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert "does not accept images" in e.value.body["error"]["message"]


def test_x_api_key_is_checked_and_errors_stay_in_anthropics_shape():
    [nobody] = pick_free_ports(1)  # no router there: a request the keys let in is a 503
    config = GatewayConfig(port=0, router_address=f"127.0.0.1:{nobody}")
    with gateway_in_thread(config, make_tokenizer(), AuthConfig(api_keys=(KEY,))) as url:
        base = url.removesuffix("/v1")
        stranger = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            stranger.messages.create(model="m", max_tokens=4, messages=QUESTION)
        assert e.value.body["error"]["type"] == "authentication_error"

        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model="m", max_tokens=4, messages=QUESTION)
        assert e.value.status_code == 503
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert "cannot serve" in e.value.body["error"]["message"]
