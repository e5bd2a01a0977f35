"""Structured output bookkeeping without the model: the constraint's validation and wire form,
the grammar cache, matchers (accept, reject, replay, terminate) and the batched mask.

Uses the bundled model's tokenizer only (cached HF files), no weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.sampler import device_only
from llmfleet.engine.structured import GrammarCache, MaskFiller, grammar_status
from llmfleet.models.checkpoint_files import resolve_model_path
from llmfleet.models.tokenizer import gguf_tokenizer
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.structured_output import StructuredOutput, parse_grammar
from llmfleet.shared.wire.convert import sampling_from_pb, sampling_to_pb
from llmfleet.v1 import common_pb2

EOS = 2  # <|im_end|> of SmolLM2-Instruct
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, VOCAB, [EOS])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


CONSTRAINTS = [
    StructuredOutput("json_schema", json.dumps({"type": "object"})),
    StructuredOutput("json_object"),
    StructuredOutput("regex", r"\d+"),
    StructuredOutput("choice", choices=("yes", 'say "no"')),
    StructuredOutput("grammar", 'root ::= "a" root | "b"'),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_constraint_round_trips_the_wire(constraint):
    params = SamplingParams(structured_output=constraint, max_tokens=7)
    assert sampling_from_pb(sampling_to_pb(params)) == params
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).structured_output is None


@pytest.mark.parametrize(
    ("set_field", "field", "problem"),
    [
        (lambda so: setattr(so, "json_schema", "{not json"), "json_schema", "not valid JSON"),
        (lambda so: setattr(so, "json_schema", "[1]"), "json_schema", "object or a boolean"),
        (lambda so: setattr(so, "regex", ""), "regex", "must not be empty"),
        (lambda so: so.choice.SetInParent(), "choice", "at least one choice"),
        (lambda so: so.choice.choices.extend(["a", ""]), "choice", "non-empty strings"),
        (lambda so: setattr(so, "json_object", False), "json_object", "must be true"),
        (lambda so: so.SetInParent(), "", "name one kind"),
    ],
)
def test_malformed_constraint_names_its_field(set_field, field, problem):
    pb = common_pb2.SamplingParams()
    set_field(pb.structured_output)
    with pytest.raises(ValidationError) as e:
        sampling_from_pb(pb)
    expected = "sampling.structured_output" + (f".{field}" if field else "")
    assert e.value.field == expected
    assert problem in e.value.message


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput("regex", "(?<=a)b"), "Lookbehind is not supported"),
        (StructuredOutput("json_schema", '{"type": "strin"}'), 'Unsupported type "strin"'),
        (
            StructuredOutput("json_schema", '{"type": "string", "pattern": "a(b"}'),
            "parenthesis is not closed",
        ),
        (
            StructuredOutput(
                "json_schema",
                '{"type": "object", "properties": {"t": {"type": "array", "uniqueItems": true}}}',
            ),
            'unsupported JSON schema feature "uniqueItems" at /properties/t/uniqueItems',
        ),
        (
            StructuredOutput("json_schema", '{"anyOf": [{"not": {"type": "null"}}]}'),
            '"not" at /anyOf/0/not',
        ),
        (StructuredOutput("grammar", 'start ::= "a"'), 'root rule with name "root"'),
        (StructuredOutput("grammar", 'root ::= "a" x'), 'Rule "x" is not defined'),
    ],
)
def test_invalid_grammar_is_a_validation_error_naming_the_problem(constraint, problem, grammars):
    with pytest.raises(ValidationError) as e:
        parse_grammar(constraint)  # what the router checks, without a vocabulary
    assert e.value.field == f"structured_output.{constraint.kind}"
    assert problem in e.value.message
    with pytest.raises(ValidationError) as e:
        grammars.compile(constraint)  # what the worker checks
    assert str(e.value).startswith(f"sampling.structured_output.{constraint.kind}: ")
    assert problem in e.value.message


def test_grammar_cache_is_a_bounded_lru(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, [EOS], capacity=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    assert cache.compile(a) is cache.compile(a)
    cache.compile(b)
    cache.compile(a)  # a is now the most recent: c evicts b
    cache.compile(c)
    assert cache.num_compiled == 3
    cache.compile(a)
    assert cache.num_compiled == 3
    cache.compile(b)
    assert cache.num_compiled == 4


def test_matcher_accepts_rejects_and_terminates_on_eos(tokenizer, grammars):
    m = grammars.matcher(StructuredOutput("choice", choices=("yes", "no")))
    assert not m.accept(EOS)  # the grammar cannot end before a choice
    assert not m.accept(ids(tokenizer, "maybe")[0])
    for t in ids(tokenizer, "yes"):
        assert m.accept(t)
    assert not m.terminated
    assert not m.accept(ids(tokenizer, "!")[0])  # a rejected token leaves the state as it was
    assert m.accept(EOS)
    assert m.terminated


def test_replay_feeds_tokens_generated_elsewhere(tokenizer, grammars):
    regex = StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}")
    m = grammars.matcher(regex, replay=ids(tokenizer, "555-"))
    for t in ids(tokenizer, "1234"):
        assert m.accept(t)
    assert m.accept(EOS)
    with pytest.raises(ValidationError, match=r"sampling\.structured_output\.regex: token"):
        grammars.matcher(regex, replay=ids(tokenizer, "55x"))


def test_mask_masks_only_the_constrained_rows(tokenizer, grammars):
    masks = MaskFiller(VOCAB, torch.device("cpu"))
    try:
        choice = grammars.matcher(StructuredOutput("choice", choices=("yes", "no")))
        digits = grammars.matcher(StructuredOutput("regex", "[0-9]"))
        logits = torch.randn(3, VOCAB)
        before = logits.clone()
        masks.apply(masks.start(3, [(0, choice), (2, digits)]), logits)
        assert torch.equal(logits[1], before[1])
        allowed0 = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
        assert allowed0 >= {ids(tokenizer, "yes")[0], ids(tokenizer, "no")[0]}
        assert EOS not in allowed0
        for t in allowed0:  # every allowed token starts one of the choices
            piece = tokenizer.decode([t])
            assert "yes".startswith(piece) or "no".startswith(piece)
        allowed2 = torch.isfinite(logits[2]).nonzero().flatten().tolist()
        assert {tokenizer.decode([t]) for t in allowed2} == set("0123456789")
        torch.testing.assert_close(logits[0, list(allowed0)], before[0, list(allowed0)])
    finally:
        masks.close()


def test_grammar_status_ends_on_termination_and_on_a_broken_grammar(tokenizer, grammars):
    params = SamplingParams(structured_output=StructuredOutput("choice", choices=("no",)))
    req = Request("r", [1, 2, 3], params, frozenset({EOS}), block_size=16)
    req.matcher = grammars.matcher(params.structured_output)
    [no] = ids(tokenizer, "no")
    req.append_output(no, None)
    assert grammar_status(req) is None
    req.append_output(EOS, None)
    assert grammar_status(req) is RequestStatus.FINISHED_STOPPED
    broken = Request("b", [1, 2, 3], params, frozenset({EOS}), block_size=16)
    broken.matcher = grammars.matcher(params.structured_output)
    broken.append_output(ids(tokenizer, "yes")[0], None)
    assert grammar_status(broken) is RequestStatus.FINISHED_ABORTED


def test_constrained_rows_never_sample_ahead_of_the_host():
    constrained = SamplingParams(structured_output=StructuredOutput("regex", "a"))
    assert device_only(SamplingParams(), 0, True)
    assert not device_only(constrained, 0, True)
