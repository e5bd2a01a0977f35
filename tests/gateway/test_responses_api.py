"""The official `openai` SDK's Responses API (`client.responses`) against a fleet started by
`llmfleet up` on the bundled model: plain and streamed answers, instructions, continuing a
stored conversation, the store's GET/DELETE, and a function tool. Greedy outputs must equal
the chat completion of the same conversation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER,
    }
]
GREEDY = {"temperature": 0.0}


def _chat(oai, model, messages, max_tokens):
    res = oai.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, **GREEDY
    )
    return res.choices[0].message.content, res.usage


def test_plain_and_streamed_answers_equal_greedy_chat(oai, model):
    question = [{"role": "user", "content": "Name three colors."}]
    text, usage = _chat(oai, model, question, 8)
    res = oai.responses.create(
        model=model, input="Name three colors.", max_output_tokens=8, **GREEDY
    )
    assert res.id.startswith("resp_") and res.object == "response" and res.model == model
    [item] = res.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and res.output_text == text
    assert res.usage.input_tokens == usage.prompt_tokens
    assert res.usage.output_tokens == usage.completion_tokens
    assert res.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if usage.completion_tokens == 8:  # cut short: OpenAI's incomplete status
        assert res.status == "incomplete"
        assert res.incomplete_details.reason == "max_output_tokens"
    else:
        assert res.status == "completed" and res.incomplete_details is None

    events = list(
        oai.responses.create(
            model=model, input=question, max_output_tokens=8, stream=True, **GREEDY
        )
    )
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{res.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.status == res.status
    assert final.usage.output_tokens == usage.completion_tokens


def test_instructions_are_a_system_message(oai, model):
    instructions = "You are a pirate. Answer like one."
    text, usage = _chat(
        oai,
        model,
        [{"role": "system", "content": instructions}, {"role": "user", "content": "Hello!"}],
        6,
    )
    res = oai.responses.create(
        model=model, instructions=instructions, input="Hello!", max_output_tokens=6, **GREEDY
    )
    assert res.output_text == text and res.instructions == instructions
    assert res.usage.input_tokens == usage.prompt_tokens


def test_previous_response_id_continues_the_stored_conversation(oai, model):
    first = oai.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]}],
        max_output_tokens=6,
        **GREEDY,
    )
    second = oai.responses.create(
        model=model,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=6,
        **GREEDY,
    )
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    text, usage = _chat(oai, model, conversation, 6)
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage.input_tokens == usage.prompt_tokens

    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, previous_response_id="resp_unknown", input="Hi")
    assert e.value.status_code == 404 and "resp_unknown" in e.value.message
    assert e.value.body["param"] == "previous_response_id"


def test_stored_responses_can_be_read_and_deleted_and_unstored_ones_cannot(oai, model):
    kept = oai.responses.create(model=model, input="Hi", max_output_tokens=2, **GREEDY)
    again = oai.responses.retrieve(kept.id)
    assert again.id == kept.id and again.output_text == kept.output_text
    oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(kept.id)

    unstored = oai.responses.create(
        model=model, input="Hi", max_output_tokens=2, store=False, **GREEDY
    )
    assert unstored.output_text == kept.output_text
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.retrieve(unstored.id)
    assert e.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, previous_response_id=unstored.id, input="Hi")


def test_a_required_function_tool_returns_a_call_whose_arguments_validate(oai, model):
    ask = "What is the weather in Paris?"
    res = oai.responses.create(
        model=model, input=ask, tools=TOOLS, tool_choice="required", max_output_tokens=32, **GREEDY
    )
    calls = [item for item in res.output if item.type == "function_call"]
    assert calls and res.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)

    # The tool's answer goes back in as a function_call_output item, after the stored call.
    follow = oai.responses.create(
        model=model,
        previous_response_id=res.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        **GREEDY,
    )
    assert follow.output[0].type == "message" and follow.usage.output_tokens >= 1
    assert follow.usage.input_tokens > res.usage.input_tokens


def test_a_named_function_streams_its_arguments(oai, model):
    events = list(
        oai.responses.create(
            model=model,
            input="What is the weather in Paris?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=24,
            stream=True,
            **GREEDY,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = events[-3]
    assert "".join(pieces) == done.arguments and done.name == "get_weather"
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments


def test_a_json_schema_text_format_returns_json_that_validates(oai, model):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}
    res = oai.responses.create(
        model=model, input="Pick a color.", text={"format": fmt}, max_output_tokens=16, **GREEDY
    )
    jsonschema.validate(json.loads(res.output_text), schema)
    assert res.status == "completed" and res.text.format.type == "json_schema"


def test_unsupported_input_is_a_400_naming_it(oai, model):
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input=[{"role": "user", "content": [image]}])
    assert e.value.body["param"] == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model=model, input="Hi", tools=[{"type": "web_search"}], max_output_tokens=2
        )
    assert e.value.body["param"] == "tools[0].type"
