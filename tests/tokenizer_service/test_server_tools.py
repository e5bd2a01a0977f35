"""Tools and tool turns through the tokenizer service: a chat with tools, tool calls and tool
results tokenizes as the core function renders it; bad tool fields are INVALID_ARGUMENT naming
their path in the request."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from llmfleet.shared.wire.chat import chat_messages_to_pb, tools_to_pb
from llmfleet.text.chat import tokenize_chat
from llmfleet.v1 import common_pb2, tokenizer_pb2

from .service_helpers import serving

pytestmark = pytest.mark.timeout(120)

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_chat_with_tools_tokenizes_as_the_core_renders_it(tokenizer):
    chat = common_pb2.ChatPrompt(messages=chat_messages_to_pb(MESSAGES), tools=tools_to_pb(TOOLS))

    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            got = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat))
            want = tokenize_chat(tokenizer, MESSAGES, tools=TOOLS)
            assert list(got.token_ids) == want
            assert want != tokenize_chat(tokenizer, MESSAGES)  # the tools are in the prompt
            text = tokenizer.decode(want)
            assert json.dumps(TOOLS[0]["parameters"]) in text and "<tool_response>" in text

    asyncio.run(body())


@pytest.mark.parametrize(
    ("tool", "field"),
    [
        (common_pb2.Tool(name="", parameters="{}"), "chat.tools[0].name"),
        (common_pb2.Tool(name="f", parameters="{not json"), "chat.tools[0].parameters"),
        (common_pb2.Tool(name="f", parameters="[1]"), "chat.tools[0].parameters"),
    ],
)
def test_bad_tools_are_invalid_argument_naming_the_field(tokenizer, tool, field):
    chat = common_pb2.ChatPrompt(messages=chat_messages_to_pb(MESSAGES[:1]), tools=[tool])

    async def body() -> None:
        async with serving(tokenizer) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: ")

    asyncio.run(body())
