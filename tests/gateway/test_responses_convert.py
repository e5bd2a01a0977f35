"""The Responses API's conversions without a fleet: input items to chat messages, output items
back to the stored conversation, text.format to a constraint (output_format.py), and the errors
naming fields."""

from __future__ import annotations

import json

import pytest

from llmfleet.services.gateway import responses_convert as rc
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.output_format import format_constraint


def _req(**fields) -> rc.ResponsesRequest:
    return rc.ResponsesRequest(model="m", input=fields.pop("input", "hi"), **fields)


def test_input_items_become_chat_messages_with_tool_turns():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]  # fmt: skip
    assert rc.input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "name": "f", "arguments": "{}"},
                {"id": "call_2", "name": "g", "arguments": '{"x": 1}'},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "done"},
    ]
    assert rc.input_messages("hello") == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0]"),
        ([{"type": "reasoning", "summary": []}], "input[0].type"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([], "input"),
    ],
)
def test_bad_input_items_are_400s_naming_them(items, param):
    with pytest.raises(APIError) as e:
        rc.input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_output_items_become_one_assistant_turn():
    output = [
        rc.message_item("msg_1", "Let me check.", "completed"),
        rc.function_call_item("fc_1", "call_9", "f", '{"a": 1}', "completed"),
    ]
    assert rc.output_messages(output) == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"id": "call_9", "name": "f", "arguments": '{"a": 1}'}],
        }
    ]


def test_text_format_becomes_a_constraint_and_names_its_field():
    assert format_constraint(None, "text.format") == (None, None)
    assert format_constraint({"type": "text"}, "text.format") == (None, None)
    so, param = format_constraint({"type": "json_object"}, "text.format")
    assert so.json_object and param == "text.format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    so, param = format_constraint(fmt, "text.format")
    assert json.loads(so.json_schema) == schema and param == "text.format.schema"
    with pytest.raises(APIError) as e:
        format_constraint({"type": "json_schema", "schema": {"type": 5}}, "output_config.format")
    assert e.value.status == 400 and e.value.param == "output_config.format.schema"


def test_tools_and_tool_choice_in_the_chat_form():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    req = _req(tools=[tool], tool_choice={"type": "function", "name": "f"})
    assert rc.function_tools(req) == [
        {"name": "f", "description": "", "parameters": {"type": "object"}}
    ]
    assert rc.tool_choice(req) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(APIError) as e:
        rc.function_tools(_req(tools=[{"type": "file_search"}]))
    assert e.value.param == "tools[0].type"


def test_status_follows_the_finish_reason():
    assert rc.status_of("stop", []) == ("completed", None)
    assert rc.status_of("length", []) == ("incomplete", {"reason": "max_output_tokens"})
