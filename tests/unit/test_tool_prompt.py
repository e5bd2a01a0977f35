"""Tools and tool turns through the chat template: natively for a template that reads `tools`,
`tool_calls` and "tool" messages; in the Hermes format for one that does not (SmolLM2's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmfleet.services.gateway.tools import tool_parser_for
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.chat import (
    chat_messages_from_pb,
    chat_messages_to_pb,
    tools_from_pb,
    tools_to_pb,
)
from llmfleet.text.chat import render_chat
from llmfleet.text.tool_prompt import template_support

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "rainy", "tool_call_id": "call_2"},
]
# A Qwen-like template that knows tools, tool calls and tool messages.
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}={{ t.function.parameters | "
    "tojson }};{% endfor %}|{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}[tool {{ m.tool_call_id }}] {{ m.content }}|"
    "{% elif m.tool_calls %}[assistant calls]{% for c in m.tool_calls %} {{ c.id }}:"
    "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}|"
    "{% else %}[{{ m.role }}] {{ m.content }}|{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_template_support_is_read_from_the_template(smollm2_tokenizer) -> None:
    smol = template_support(smollm2_tokenizer.chat_template)
    assert not (smol.tools or smol.tool_calls or smol.tool_role)
    native = template_support(NATIVE)
    assert native.tools and native.tool_calls and native.tool_role


def test_tools_fall_back_to_a_hermes_system_prompt(smollm2_tokenizer) -> None:
    text = render_chat(smollm2_tokenizer, ROUND_TRIP[:1], tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed)["function"] == {**TOOLS[0]}
    assert "<tool_call>" in system and "SmolLM" not in text  # replaces the default system
    assert text.endswith("<|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip

    own = [{"role": "system", "content": "Be brief."}, *ROUND_TRIP[:1]]
    text = render_chat(smollm2_tokenizer, own, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_tool_round_trip_in_hermes_format_parses_back(smollm2_tokenizer) -> None:
    text = render_chat(smollm2_tokenizer, ROUND_TRIP, tools=TOOLS)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = tool_parser_for("hermes").parse(assistant)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    # Both tool results share one user turn, in order.
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_native_template_gets_tools_and_tool_turns(make_byte_fallback_tokenizer) -> None:
    tok = make_byte_fallback_tokenizer(NATIVE)
    text = render_chat(tok, ROUND_TRIP, tools=TOOLS)
    assert text == (
        f"TOOLS:get_weather={_jinja_tojson(tok, WEATHER)};|"
        "[user] Weather in Oslo and Rome?|"
        "[assistant calls] call_1:get_weather(Oslo) call_2:get_weather(Rome)|"
        "[tool call_1] sunny|[tool call_2] rainy|[assistant]"
    )


def _jinja_tojson(tok: Any, value: Any) -> str:
    """How the template's `tojson` spells `value` (HF's filter, not json.dumps' spacing)."""
    return tok.apply_chat_template(
        [{"role": "user", "content": ""}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": value}}],
        chat_template="{{ tools[0].function.parameters | tojson }}",
        tokenize=False,
    )


def test_lone_tool_message_without_tools_renders_as_before(byte_fallback_tokenizer) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    text = render_chat(byte_fallback_tokenizer, messages, add_generation_prompt=False)
    assert text == "<s>[user] a\n[tool] b\n"


def test_bad_tool_calls_name_the_field(smollm2_tokenizer) -> None:
    for messages, field in [
        ([{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}],
         "messages[0].tool_calls"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"arguments": "{}"}]}],
         "messages[0].tool_calls[0]"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError) as err:
            render_chat(smollm2_tokenizer, messages)
        assert err.value.field == field


def test_wire_round_trip_of_messages_and_tools() -> None:
    assert chat_messages_from_pb(chat_messages_to_pb(ROUND_TRIP)) == ROUND_TRIP
    assert tools_from_pb(tools_to_pb(TOOLS)) == TOOLS
    with pytest.raises(ValidationError) as err:
        tools_to_pb([{"name": "f", "parameters": "not a dict"}])
    assert err.value.field == "tools[0].parameters"
