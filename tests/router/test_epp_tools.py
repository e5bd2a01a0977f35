"""The endpoint picker reads a chat with tools as the gateway sends it to the router, so the
prompt it hashes for the pick is the one Generate renders."""

from __future__ import annotations

import json

from llmfleet.client.messages import build_request
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.protocol import ChatCompletionRequest
from llmfleet.services.router.epp_pick import openai_prompt

BODY = {
    "model": "m",
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ],
}


def test_epp_chat_with_tools_equals_the_gateways():
    kwargs = convert.chat_call(ChatCompletionRequest(**BODY)).kwargs
    kwargs.pop("structured_output", None)
    sent = build_request(**kwargs).chat
    picked = openai_prompt("/v1/chat/completions", json.dumps(BODY).encode()).chat
    assert picked == sent
    assert [m.tool_call_id for m in picked.messages] == ["", "", "call_1"]
    assert [t.name for t in picked.tools] == ["get_weather", "get_time"]
