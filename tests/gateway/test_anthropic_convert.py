"""Anthropic Messages conversions without a fleet: blocks to chat messages, tool choices,
stop reasons and errors in Anthropic's shape."""

from __future__ import annotations

import pytest

from llmfleet.services.gateway import anthropic_convert as ac
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.tool_parsers import ToolCall
from llmfleet.shared.core.image_source import ImageSource


def _req(messages, **fields) -> ac.MessagesRequest:
    return ac.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 4, "messages": messages, **fields}
    )


def test_blocks_become_chat_messages_with_tool_turns():
    req = _req(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "P"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
    )
    assert ac.chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "toolu_1", "name": "w", "arguments": '{"city": "P"}'}],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: no such city", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks"},
    ]


def test_image_blocks_become_image_parts_in_order():
    png = {"type": "base64", "media_type": "image/png", "data": "AAEC"}
    blocks = [
        {"type": "text", "text": "a"},
        {"type": "image", "source": png},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "text", "text": "b"},
    ]
    assert ac.chat_messages(_req([{"role": "user", "content": blocks}])) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image", "image": ImageSource(data=b"\x00\x01\x02")},
                {"type": "image", "image": ImageSource(url="https://x/y.png")},
                {"type": "text", "text": "b"},
            ],
        }
    ]
    png["data"] = "AA=C"
    with pytest.raises(APIError) as e:
        ac.chat_messages(_req([{"role": "user", "content": blocks}]))
    assert e.value.status == 400 and e.value.param == "messages[0].content[1].source.data"
    assert "malformed base64" in e.value.message


def test_part_origins_name_the_requests_blocks_by_the_chats_paths():
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAEC"}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": "42"}
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    req = _req(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result, {"type": "text", "text": "see"}, png]},
        ]
    )
    req.system = "Be brief."
    # chat: [system, user "hi", assistant (call), tool (result), user [text, image]]
    assert len(ac.chat_messages(req)) == 5
    origins = ac.part_origins(req)
    assert origins["chat.messages[1].content"] == "messages[0].content"
    assert origins["chat.messages[4].parts[0]"] == "messages[2].content[1]"
    assert origins["chat.messages[4].parts[1]"] == "messages[2].content[2]"


def test_unsupported_blocks_are_400s_naming_them():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(APIError) as e:
        ac.chat_messages(_req([{"role": "user", "content": [image]}]))
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].source.data"
    image["source"] = {"type": "file", "file_id": "f"}
    with pytest.raises(APIError) as e:
        ac.chat_messages(_req([{"role": "user", "content": [image]}]))
    assert e.value.param == "messages[0].content[0].source.type"
    with pytest.raises(APIError) as e:  # images come from users only
        ac.chat_messages(_req([{"role": "assistant", "content": [image]}]))
    assert e.value.param == "messages[0].content[0].type"
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    with pytest.raises(APIError):  # a user turn does not call tools
        ac.chat_messages(_req([{"role": "user", "content": [use]}]))


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, (None, True)),
        ({"type": "auto"}, ("auto", True)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
        ({"type": "tool", "name": "f"}, ({"type": "function", "function": {"name": "f"}}, True)),
        ({"type": "none"}, ("none", True)),
    ],
)
def test_tool_choice_maps_onto_chats(choice, expected):
    assert ac.tool_choice(_req([{"role": "user", "content": "x"}], tool_choice=choice)) == expected


def test_stop_reasons():
    call = ToolCall("call_1", "f", '{"a": 1}')
    cut = ToolCall("call_2", "f", '{"a": ')
    assert ac.stop_reason("stop", "", []) == "end_turn"
    assert ac.stop_reason("stop", "###", []) == "stop_sequence"
    assert ac.stop_reason("length", "", []) == "max_tokens"
    assert ac.stop_reason("length", "", [call]) == "tool_use"  # whole calls, padded to the limit
    assert ac.stop_reason("length", "", [cut]) == "max_tokens"
    assert ac.tool_use_block(call) == {
        "type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1},
    }  # fmt: skip


def test_errors_in_anthropics_shape():
    assert ac.error_body(APIError(429, "slow down")) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert ac.error_type(503) == "overloaded_error" and ac.error_type(500) == "api_error"
    err = ac.body_error([{"loc": ("max_tokens",), "msg": "Field required"}])
    assert err.status == 400 and err.message == "max_tokens: Field required"
