"""Benchmark datasets: lengths, sharing of prefixes, ShareGPT parsing, determinism, errors."""

from __future__ import annotations

import collections
import json

import pytest
from fake_tokenizer import SPECIAL_ID, FakeTokenizer

from llmfleet.cli.benchserve import datasets
from llmfleet.shared.core.errors import ValidationError

TOK = FakeTokenizer()


def test_random_lengths_cover_the_range_ratio_interval():
    reqs = datasets.random_requests(
        TOK, num_prompts=400, input_len=100, output_len=20, range_ratio=0.5, seed=1
    )
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert len(reqs) == 400
    assert min(ins) >= 50 and max(ins) <= 150 and {50, 150} & set(ins)
    assert min(outs) >= 10 and max(outs) <= 30 and min(outs) <= 12 and max(outs) >= 28
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert SPECIAL_ID not in r.prompt


def test_random_without_range_is_exact_and_seeded():
    a = datasets.random_requests(TOK, num_prompts=5, input_len=7, output_len=3, seed=4)
    b = datasets.random_requests(TOK, num_prompts=5, input_len=7, output_len=3, seed=4)
    c = datasets.random_requests(TOK, num_prompts=5, input_len=7, output_len=3, seed=5)
    assert a == b and a != c
    assert {(r.prompt_len, r.expected_output_len) for r in a} == {(7, 3)}


def test_random_text_prompts_encode_to_the_requested_length():
    # Merges make decoded ids re-encode shorter; the generator tops the text up.
    reqs = datasets.random_requests(
        TOK, num_prompts=50, input_len=40, output_len=5, seed=2, as_text=True
    )
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(TOK.encode(r.prompt))
        assert abs(r.prompt_len - 40) <= 1
    assert sum(r.prompt_len == 40 for r in reqs) >= 45


def test_bad_lengths_name_the_argument():
    with pytest.raises(ValidationError) as e:
        datasets.random_requests(TOK, num_prompts=1, input_len=8, output_len=2, range_ratio=1.0)
    assert e.value.field == "--random-range-ratio"
    with pytest.raises(ValidationError) as e:
        datasets.random_requests(TOK, num_prompts=1, input_len=0, output_len=2)
    assert e.value.field == "--random-input-len"
    with pytest.raises(ValidationError) as e:
        datasets.random_requests(TOK, num_prompts=0, input_len=4, output_len=2)
    assert e.value.field == "--num-prompts"


def test_prefix_repetition_shares_few_prefixes_equally_and_shuffled():
    reqs = datasets.prefix_repetition_requests(
        TOK, num_prompts=12, prefix_len=10, suffix_len=3, num_prefixes=3, output_len=4, seed=0
    )
    assert all(len(r.prompt) == 13 == r.prompt_len for r in reqs)
    assert all(r.expected_output_len == 4 for r in reqs)
    counts = collections.Counter(tuple(r.prompt[:10]) for r in reqs)
    assert len(counts) == 3 and set(counts.values()) == {4}
    assert len({tuple(r.prompt[10:]) for r in reqs}) == 12  # every suffix its own
    order = [list(counts).index(tuple(r.prompt[:10])) for r in reqs]
    assert order != [i % 3 for i in range(12)]  # not in generation order


def test_prefix_repetition_text_prompts_start_with_their_shared_prefix_text():
    tok = FakeTokenizer(merges=False)
    reqs = datasets.prefix_repetition_requests(
        tok, num_prompts=6, prefix_len=8, suffix_len=4, num_prefixes=2, output_len=2, as_text=True
    )
    assert len({r.prompt[:8] for r in reqs}) == 2
    assert all(len(r.prompt) == 12 == r.prompt_len for r in reqs)


def test_prefix_repetition_rejects_bad_sizes():
    with pytest.raises(ValidationError) as e:
        datasets.prefix_repetition_requests(
            TOK, num_prompts=2, prefix_len=4, suffix_len=1, num_prefixes=0, output_len=2
        )
    assert e.value.field == "--prefix-repetition-num-prefixes"


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_first_human_turn_and_reply_length(tmp_path):
    tok = FakeTokenizer(merges=False)
    data = [
        _conv(("human", "hello there"), ("gpt", "general kenobi"), ("human", "x"), ("gpt", "y")),
        _conv(("system", "be nice"), ("human", "what is this"), ("gpt", "a test of it")),
        _conv(("human", "hi"), ("gpt", "too short a prompt")),  # prompt < 4 tokens: skipped
        _conv(("gpt", "only the model speaks")),  # no exchange: skipped
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_requests(tok, path, num_prompts=2, seed=0)
    got = {r.prompt: (r.prompt_len, r.expected_output_len) for r in reqs}
    assert got == {"hello there": (11, 14), "what is this": (12, 12)}
    fixed = datasets.sharegpt_requests(tok, path, num_prompts=2, output_len=7)
    assert {r.expected_output_len for r in fixed} == {7}
    with pytest.raises(ValidationError, match="only 2 usable") as e:
        datasets.sharegpt_requests(tok, path, num_prompts=3)
    assert e.value.field == "--num-prompts"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ('{"conversations": []}', "JSON list"),
        ('[{"turns": []}]', "conversations"),
    ],
)
def test_sharegpt_bad_files_name_the_path(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValidationError, match=message) as e:
        datasets.sharegpt_requests(TOK, path, num_prompts=1)
    assert e.value.field == "--dataset-path"
