"""Structured output through a real disaggregated fleet of the bundled SmolLM2-135M-Instruct,
over gRPC: the prefill worker samples the first token under the constraint, the decode worker's
matcher accepts it and goes on; invalid constraints are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from fleet_helpers import WORKER_ARGS, wait_all_blocks_free

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import AsyncGenerationClient, ClientError, GenerationClient
from llmfleet.v1 import common_pb2

pytestmark = pytest.mark.slow

SHORT = 16  # chat prompts are longer: they go through the prefill worker and the KV lease
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "level": {"enum": ["low", "mid", "high"]},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {"team": {"type": "string", "maxLength": 10}},
            "required": ["team"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "level", "scores", "owner"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a project as JSON: name, level, scores, owner."}]


@pytest.fixture(scope="module")
def fleet():
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        extra_args={
            "worker": WORKER_ARGS,
            "router": ["--short-prompt-threshold", str(SHORT)],
        },
        startup_timeout_s=240,
    )
    with Fleet(spec) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return GenerationClient(fleet.endpoint)


def assert_idle(fleet) -> None:
    for s in wait_all_blocks_free(fleet):
        assert (s.load.num_running, s.load.num_waiting, s.load.num_active_leases) == (0, 0, 0)
        assert s.load.num_free_blocks == s.load.num_total_blocks


def schema_constraint() -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))


def test_sampled_outputs_validate_through_the_handoff(fleet, client):
    """4 single completions through the lease (seeds 0..3) and one n=4 request (seeds 4..7,
    prefilled by the decode worker itself), all concurrent. (Twenty sampled generations are
    checked on the engine: tests/engine/test_structured_output.py.)"""

    async def run() -> list:
        aclient = AsyncGenerationClient(fleet.endpoint)
        common = {"temperature": 1.0, "max_tokens": 120, "structured_output": schema_constraint()}
        calls = [aclient.generate(messages=MESSAGES, seed=s, **common) for s in range(4)]
        calls.append(aclient.generate(messages=MESSAGES, seed=4, n=4, **common))
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    completions = [c for res in results for c in res.completions]
    assert len(completions) == 8
    for c in completions:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in completions}) > 1
    assert_idle(fleet)


def test_regex_and_choice_hold_over_grpc(client):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    for seed in range(2):
        res = client.generate(
            messages=[{"role": "user", "content": "When did the project start? Give a date."}],
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            structured_output=common_pb2.StructuredOutput(regex=date),
        )
        assert re.fullmatch(date, res.completions[0].text), res.completions[0].text
        choices = ["approve", "reject"]
        res = client.generate(
            messages=[{"role": "user", "content": "Should we merge this change?"}],
            temperature=1.0,
            seed=seed,
            max_tokens=8,
            structured_output=common_pb2.StructuredOutput(
                choice=common_pb2.ChoiceList(choices=choices)
            ),
        )
        assert res.completions[0].text in choices
        assert res.completions[0].finish_reason == "stop"


def test_permissive_grammar_changes_no_greedy_token_over_grpc(client):
    common = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": 24}
    plain = client.generate(**common).completions[0]
    free = client.generate(
        structured_output=common_pb2.StructuredOutput(grammar="root ::= [^]*"), **common
    ).completions[0]
    assert free.token_ids == plain.token_ids
    assert free.text == plain.text


@pytest.mark.parametrize(
    ("constraint", "field", "problem"),
    [
        (common_pb2.StructuredOutput(json_schema='{"type": "strin"}'), "json_schema", "strin"),
        (common_pb2.StructuredOutput(json_schema="{oops"), "json_schema", "not valid JSON"),
        (common_pb2.StructuredOutput(regex="(?<=a)b"), "regex", "Lookbehind"),
        (
            common_pb2.StructuredOutput(json_schema='{"type": "string", "format": "iri"}'),
            "json_schema",
            'unsupported JSON schema feature "format": "iri"',
        ),
        (common_pb2.StructuredOutput(grammar='start ::= "a"'), "grammar", "root"),
        (
            common_pb2.StructuredOutput(choice=common_pb2.ChoiceList()),
            "choice",
            "at least one choice",
        ),
    ],
)
def test_invalid_constraint_is_invalid_argument_naming_the_field(
    fleet, client, constraint, field, problem
):
    with pytest.raises(ClientError) as e:
        client.generate(messages=MESSAGES, max_tokens=8, structured_output=constraint)
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert e.value.message.startswith(f"sampling.structured_output.{field}: ")
    assert problem in e.value.message
    assert_idle(fleet)  # nothing was left queued or holding KV
