"""Structured output on the bundled SmolLM2-135M-Instruct through the engine: sampled outputs
obey JSON schemas, regexes and choices; a permissive grammar changes no greedy token; invalid
constraints are rejected before anything is queued; logprobs, preemption and a migration's
replayed tokens keep the grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from llmfleet.client.llm import LLM
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.structured_output import StructuredOutput

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}
PROMPT = "Give me a user record as JSON with a name, a role, an address and some tags."
# Short outputs for the tests that only need some constraint to keep (the CPU is slow).
SMALL = {
    "type": "object",
    "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "ok": {"type": "boolean"}},
    "required": ["zip", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def llm(loaded) -> LLM:
    return LLM(EngineConfig(), loaded=loaded)


def constrained(kind: str, spec: str = "", **kw) -> SamplingParams:
    choices = kw.pop("choices", ())
    return SamplingParams(structured_output=StructuredOutput(kind, spec, choices), **kw)


def test_twenty_sampled_outputs_validate_against_a_nested_schema(llm):
    # Two requests of n=10: completion i of a request seeded s uses seed s + i, so 0..19.
    params = [
        constrained(
            "json_schema", json.dumps(SCHEMA), n=10, seed=s, temperature=1.0, max_tokens=120
        )
        for s in (0, 10)
    ]
    results = llm.generate([PROMPT, PROMPT], params, chat=True)
    completions = [c for res in results for c in res.completions]
    assert len(completions) == 20
    for c in completions:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in completions}) > 1  # really sampled


def test_regex_and_choice_hold_for_every_seed(llm):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ("positive", "negative", "neutral")
    params = [
        constrained("regex", phone, seed=s, temperature=1.0, max_tokens=24) for s in range(4)
    ] + [
        constrained("choice", choices=choices, seed=s, temperature=1.0, max_tokens=10)
        for s in range(4)
    ]
    prompts = ["What is your phone number?"] * 4 + ["I loved this film! Sentiment?"] * 4
    results = llm.generate(prompts, params, chat=True)
    for res in results[:4]:
        [c] = res.completions
        assert re.fullmatch(phone, c.text), c.text
        assert c.finish_reason == "stop"
    for res in results[4:]:
        assert res.completions[0].text in choices


@pytest.mark.parametrize(
    "permissive",
    [
        StructuredOutput("regex", r"(.|\n)*"),
        StructuredOutput("grammar", "root ::= [^]*"),
    ],
    ids=["regex", "ebnf"],
)
def test_permissive_grammar_changes_no_greedy_token(llm, permissive):
    # One batch: the unconstrained rows next to the masked ones, each prompt both ways.
    prompts = ["Write a haiku about the sea.", "List three fruits that are red."] * 2
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    free = SamplingParams(temperature=0.0, max_tokens=24, structured_output=permissive)
    results = llm.generate(prompts, [plain, plain, free, free], chat=True)
    for expected, got in zip(results[:2], results[2:], strict=True):
        assert got.completions[0].token_ids == expected.completions[0].token_ids
        assert len(got.completions[0].token_ids) > 8


@pytest.mark.parametrize(
    ("constraint", "field", "problem"),
    [
        (StructuredOutput("json_schema", '{"type": "strin"}'), "json_schema", "Unsupported type"),
        (StructuredOutput("regex", "[a-"), "regex", "regular expression"),
        (StructuredOutput("grammar", 'root ::= "a" | '), "grammar", "EBNF parser error"),
    ],
)
def test_invalid_constraint_is_rejected_before_queueing(llm, constraint, field, problem):
    engine = llm.engine
    with pytest.raises(ValidationError) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=constraint))
    assert str(e.value).startswith(f"sampling.structured_output.{field}: ")
    assert problem in e.value.message
    assert not engine.has_unfinished() and not engine.has_request("bad")


def test_logprobs_are_those_of_the_masked_distribution(llm):
    choices = ("yes", "no")
    params = constrained("choice", choices=choices, temperature=1.0, seed=3, logprobs=5)
    [res] = llm.generate(["Is water wet? Answer yes or no."], params, chat=True)
    first = res.completions[0].logprobs[0]
    tokenizer = llm.tokenizer
    vocab = range(len(tokenizer))
    pieces = {t: tokenizer.decode([t]) for t in vocab}
    allowed = {t for t, p in pieces.items() if p and any(c.startswith(p) for c in choices)}
    finite = {
        t for t, lp in zip(first.top_token_ids, first.top_logprobs, strict=True) if lp > -1e30
    }
    assert finite <= allowed and first.token_id in allowed
    # The allowed first tokens carry the whole probability mass.
    mass = sum(
        torch.tensor(lp).exp().item()
        for t, lp in zip(first.top_token_ids, first.top_logprobs, strict=True)
        if t in allowed
    )
    assert mass == pytest.approx(1.0, abs=1e-4)


def test_preempted_constrained_requests_recompute_and_still_validate(loaded):
    # 13 blocks of 8 tokens admit two 44-token prompts (6 blocks each), not their outputs.
    config = EngineConfig(num_kv_blocks=13, block_size=8, enable_prefix_caching=False)
    tight = LLM(config, loaded=loaded)
    params = constrained("json_schema", json.dumps(SMALL), temperature=0.0, max_tokens=36)
    prompts = [f"Give a zip code and a flag as JSON, number {i}." for i in range(3)]
    results = tight.generate(prompts, params, chat=True)
    assert tight.engine.scheduler.num_preemptions_total > 0
    for res in results:
        assert res.completions[0].finish_reason == "stop"
        jsonschema.validate(json.loads(res.completions[0].text), SMALL)


def test_migrated_completion_continues_the_same_grammar(llm):
    """A completion resumed elsewhere (prompt + its tokens, num_replayed_tokens) goes on as if
    it had never moved: greedy, its tokens equal the uninterrupted run's."""
    params = constrained("json_schema", json.dumps(SMALL), temperature=0.0, max_tokens=40)
    [whole] = llm.generate(["Give a zip code and a flag as JSON."], params, chat=True)
    tokens = whole.completions[0].token_ids
    k = len(tokens) // 2
    engine = llm.engine
    resumed = constrained("json_schema", json.dumps(SMALL), temperature=0.0, max_tokens=40 - k)
    engine.add_request("moved", whole.prompt_token_ids + tokens[:k], resumed, num_replayed_tokens=k)
    rest: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.new_token_ids
    assert tokens[:k] + rest == tokens
    # Without the replay, the grammar would start over in the middle of the object.
    with pytest.raises(ValidationError, match="generated token"):
        engine.add_request(
            "bad", whole.prompt_token_ids + [9] + tokens[:k], resumed, num_replayed_tokens=k + 1
        )


@pytest.mark.gpu
def test_cuda_engine_masks_on_the_device_beside_unconstrained_rows():
    """On CUDA (graphs, async scheduling on): the mask is applied on the device; constrained
    rows validate, and a permissively constrained row decodes as its unconstrained twin in the
    same batch."""
    loaded = load_model(None, dtype=torch.float32, device="cuda", progress=False)
    llm = LLM(EngineConfig(device="cuda", dtype="float32"), loaded=loaded)
    try:
        schema = constrained(
            "json_schema", json.dumps(SCHEMA), n=10, seed=0, temperature=1.0, max_tokens=200
        )
        plain = SamplingParams(temperature=0.0, max_tokens=48)
        permissive = StructuredOutput("regex", r"(.|\n)*")
        free = SamplingParams(temperature=0.0, max_tokens=48, structured_output=permissive)
        prompts = [PROMPT, "Write a haiku about the sea.", "Write a haiku about the sea."]
        res = llm.generate(prompts, [schema, plain, free], chat=True)
        for c in res[0].completions:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        assert res[2].completions[0].token_ids == res[1].completions[0].token_ids
        assert len(res[1].completions[0].token_ids) > 8
    finally:
        llm.engine.close()
