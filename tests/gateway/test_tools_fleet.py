"""Tool calling and response formats with the official `openai` client against a fleet serving
the bundled model (SmolLM2-135M-Instruct, whose chat template ignores tools: they reach it
through the Hermes system-prompt fallback). A forced tool_choice and every response format are
enforced by the grammar, so whatever the small model writes must parse and validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
# Greedy; enough tokens for two calls (a forced choice ends at EOS once its JSON is whole).
GREEDY = {"temperature": 0.0, "max_tokens": 96}


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module")
def required(oai, model):
    """One greedy answer under tool_choice="required" (the round-trip test reuses it)."""
    return oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )


def test_required_returns_calls_whose_arguments_validate(required):
    [choice] = required.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    _check_calls([(c.function.name, c.function.arguments) for c in calls])


def test_required_streaming_and_one_call_without_parallel(oai, model):
    stream = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
        **GREEDY,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.id is not None:
                    assert tc.id.startswith("call_") and tc.type == "function"
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    _check_calls([(c["name"], c["arguments"]) for c in calls.values()])


def test_named_tool_choice_calls_that_function(oai, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    res = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY
    )
    [call] = res.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_calls([(call.function.name, call.function.arguments)])

    chunks = list(
        oai.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, stream=True, **GREEDY
        )
    )
    streamed = "".join(
        tc.function.arguments or ""
        for c in chunks
        for ch in c.choices
        for tc in ch.delta.tool_calls or ()
    )
    assert streamed == call.function.arguments  # greedy: the same call, in fragments


def test_tool_choice_none_answers_in_text(oai, model):
    res = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    [choice] = res.choices
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_results_go_back_through_the_template(oai, model, required):
    assistant = required.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'}
        for c in assistant.tool_calls
    ]
    messages = [*ASK, assistant.model_dump(exclude_none=True), *results]
    res = oai.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert res.choices[0].message.content and res.usage.completion_tokens > 0
    # The calls and their results are in the prompt: it is longer than the question's by them.
    calls_len = sum(len(c.function.arguments) for c in assistant.tool_calls) // 4
    assert res.usage.prompt_tokens > required.usage.prompt_tokens + calls_len


def test_response_format_json_schema_validates(oai, model):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"type": "string", "enum": ["admin", "user"]},
        },
        "required": ["name", "age", "role"],
    }
    res = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        **GREEDY,
    )
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), schema)


def test_response_format_json_object_is_an_object(oai, model):
    res = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object with a color."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=16,
    )
    text = res.choices[0].message.content
    if res.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: still an object's beginning
        assert text.lstrip().startswith("{")


def test_guided_choice_picks_one_of_them(oai, model):
    choices = ["positive", "negative", "neutral"]
    res = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Sentiment of: I love this!"}],
        max_tokens=8,
        extra_body={"guided_choice": choices},
    )
    assert res.choices[0].message.content in choices
    done = oai.completions.create(
        model=model, prompt="The answer is", max_tokens=8, extra_body={"guided_regex": "[0-9]{2}"}
    )
    assert len(done.choices[0].text) == 2 and done.choices[0].text.isdigit()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
         "guided_regex"),
        ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),  # refused by the fleet
    ],
)  # fmt: skip
def test_bad_tools_and_formats_are_400_naming_the_param(oai, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, **body)
    assert e.value.status_code == 400 and e.value.param == param
