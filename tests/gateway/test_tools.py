"""Tool calling and output constraints in the gateway, without a fleet: tool validation, the
schemas that enforce tool_choice (their outputs must parse into calls whose arguments validate),
the Hermes parser on whole and streamed text, and the OpenAI request -> Generate call mapping."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmfleet.client.messages import Delta
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.chat_tools import tool_call_deltas_out
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from llmfleet.services.gateway.streaming import ChunkBuilder
from llmfleet.services.gateway.tools import (
    FunctionTool,
    parse_constrained,
    parse_tool_choice,
    parse_tools,
    tool_constraint,
    tool_parser_for,
    tool_stream,
)
from llmfleet.shared.core.errors import ValidationError

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time now"}},
]


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=body.pop("messages", [{"role": "user", "content": "hi"}]), **body
    )


# ---- tools and tool_choice ------------------------------------------------------------------


def test_parse_tools_fills_missing_parameters_with_an_empty_object():
    weather, clock = parse_tools(TOOLS)
    assert weather == FunctionTool("get_weather", "", WEATHER)
    assert clock.description == "Time now"
    assert clock.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([TOOLS[0], TOOLS[0]], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ValidationError) as e:
        parse_tools(tools)
    assert e.value.field == field


def test_tool_choice_forms():
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools) == "auto"
    assert parse_tool_choice(None, []) == "none"
    assert parse_tool_choice("required", tools) == "required"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == "get_time"
    assert parse_tool_choice({"name": "get_time"}, tools) == "get_time"
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(ValidationError, match="tool_choice"):
            parse_tool_choice(bad, tools)
    with pytest.raises(ValidationError, match="requires tools"):
        parse_tool_choice("required", [])


# ---- constraints: what they admit parses into valid calls ---------------------------------


def test_required_schema_admits_exactly_calls_of_the_tools():
    tools = parse_tools(TOOLS)
    schema = json.loads(tool_constraint(tools, "required", True).json_schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],  # misses `unit`
        [{"name": "launch", "parameters": {}}],
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = parse_constrained(json.dumps(good), "required")
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == good[0]["parameters"]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    single = json.loads(tool_constraint(tools, "required", False).json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)  # parallel_tool_calls=false: one call at most
    jsonschema.validate(good[:1], single)


def test_named_schema_is_the_functions_parameters():
    tools = parse_tools(TOOLS)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert json.loads(tool_constraint(tools, choice, True).json_schema) == WEATHER
    [call] = parse_constrained('{"city": "Oslo", "unit": "celsius"}', choice)
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Oslo"
    assert tool_constraint(tools, "auto", True) is None
    assert tool_constraint(tools, "none", True) is None


def test_required_stream_announces_each_call_once_it_closes():
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": 'a}"]', "unit": "celsius"}},
            {"name": "get_time", "parameters": {}},
        ]  # fmt: skip
    )
    stream = tool_stream("required", True, "hermes")
    seen = []
    for i in range(0, len(text), 3):
        content, deltas = stream.feed(text[i : i + 3])
        assert content == ""
        seen.extend(deltas)
    entries = tool_call_deltas_out(seen)
    assert [e["function"].get("name") for e in entries] == ["get_weather", "get_time"]
    assert json.loads(entries[0]["function"]["arguments"])["city"] == 'a}"]'
    assert [c.name for c in stream.finish()] == ["get_weather", "get_time"]


# ---- the Hermes parser ----------------------------------------------------------------------

ARGS = '{"city": "Oslo", "unit": "celsius"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'


def test_hermes_whole_text_with_text_before_and_after():
    text = f"Let me check.\n{CALL}\n{CALL.replace('Oslo', 'Rome')}\nDone."
    content, calls = tool_parser_for("hermes").parse(text)
    assert content.startswith("Let me check.") and content.endswith("Done.")
    assert "tool_call" not in content
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    assert all(c.name == "get_weather" for c in calls)


def test_hermes_plain_text_and_broken_blocks_stay_content():
    assert tool_parser_for("hermes").parse("Hi <tool there") == ("Hi <tool there", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert tool_parser_for("hermes").parse(broken) == (broken, [])


def test_hermes_unclosed_block_at_the_end_is_a_call_if_whole():
    content, [call] = tool_parser_for("hermes").parse(CALL.removesuffix("</tool_call>"))
    assert content == "" and call.name == "get_weather"


def test_hermes_parallel_false_keeps_the_first_call():
    _, calls = tool_parser_for("hermes", max_calls=1).parse(CALL + CALL.replace("Oslo", "Rome"))
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Oslo"]


@pytest.mark.parametrize("step", [1, 2, 5, 11])
def test_hermes_streaming_split_anywhere_equals_whole(step):
    text = f"Sure! {CALL} and {CALL.replace('Oslo', 'Rome')} ok"
    parser = tool_parser_for("hermes")
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i : i + step])
        assert "<" not in c  # no piece of a tag is ever shown
        content += c
        deltas += d
    c, d = parser.flush()
    content, deltas = content + c, deltas + d
    whole_content, whole_calls = tool_parser_for("hermes").parse(text)
    assert content.split() == whole_content.split() == ["Sure!", "and", "ok"]
    entries = tool_call_deltas_out(deltas)
    assert [e["index"] for e in entries] == [0, 1]
    assert [json.loads(e["function"]["arguments"]) for e in entries] == [
        json.loads(c.arguments) for c in whole_calls
    ]
    assert [c.name for c in parser.finish()] == ["get_weather", "get_weather"]


# ---- requests -> Generate calls ------------------------------------------------------------


def test_chat_call_with_tools_renders_them_and_constrains_required():
    call = convert.chat_call(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert [t["name"] for t in call.kwargs["tools"]] == ["get_weather", "get_time"]
    schema = json.loads(call.kwargs["structured_output"].json_schema)
    assert schema["maxItems"] == 1
    assert call.params["structured_output.json_schema"] == "tools"

    auto = convert.chat_call(chat(tools=TOOLS))
    assert "structured_output" not in auto.kwargs and auto.tool_choice == "auto"
    none = convert.chat_call(chat(tools=TOOLS, tool_choice="none"))
    assert none.tool_parser() is None and len(none.kwargs["tools"]) == 2


def test_tool_messages_reach_the_call():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    call = convert.chat_call(chat(messages=messages, tools=TOOLS))
    assert call.kwargs["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}],
    }
    assert call.kwargs["messages"][2] == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "call_1",
    }
    with pytest.raises(APIError) as e:
        convert.chat_call(chat(messages=[{"role": "tool", "content": "x"}]))
    assert e.value.param == "messages[0].tool_call_id"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER},
                }
            },
            "json_schema",
        ),
        ({"guided_json": WEATHER}, "json_schema"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
    ],
)
def test_constraints_become_structured_output(body, kind):
    so = convert.chat_call(chat(**body)).kwargs["structured_output"]
    assert so.WhichOneof("kind") == kind
    so = convert.completion_call(CompletionRequest(model="m", prompt="x", **body))
    assert so.kwargs["structured_output"].WhichOneof("kind") == kind


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"guided_json": WEATHER, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}, "tools": TOOLS},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_param(body, param):
    with pytest.raises(APIError) as e:
        convert.chat_call(chat(**body))
    assert e.value.status == 400 and e.value.param == param


# ---- responses -----------------------------------------------------------------------------


class _Speller:
    def spell(self, token_id):
        return str(token_id), []


def test_streamed_chunks_carry_tool_calls_and_finish_with_tool_calls():
    call = convert.chat_call(chat(tools=TOOLS))
    builder = ChunkBuilder(call, "m", _Speller())
    text = f"On it. {CALL}"
    chunks = [builder.delta(Delta(0, text[i : i + 7], [])) for i in range(0, len(text), 7)]
    chunks.append(builder.delta(Delta(0, "", [], finish_reason="stop")))
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    assert "".join(d.get("content", "") for d in deltas) == "On it. "
    [entry] = [t for d in deltas for t in d.get("tool_calls", [])]
    assert entry["index"] == 0 and entry["type"] == "function" and entry["id"].startswith("call_")
    assert entry["function"]["name"] == "get_weather"
    assert json.loads(entry["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_stream_sends_name_then_argument_fragments():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    call = convert.chat_call(chat(tools=TOOLS, tool_choice=choice))
    builder = ChunkBuilder(call, "m", _Speller())
    parts = ['{"city": ', '"Oslo", "unit"', ': "celsius"}']
    chunks = [builder.delta(Delta(0, p, [])) for p in parts]
    chunks.append(builder.delta(Delta(0, "", [], finish_reason="stop")))
    entries = [t for c in chunks if c for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "get_weather" and "id" in entries[0]
    assert all("id" not in e for e in entries[1:])
    assert "".join(e["function"]["arguments"] for e in entries) == "".join(parts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
