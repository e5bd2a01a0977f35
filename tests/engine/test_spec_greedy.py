"""Speculative decoding is exact for greedy requests: with n-gram (prompt-lookup) drafts the
engine emits token for token what it emits without them, on every test architecture, across
batch sizes and draft lengths, under preemption, with n=2, stop tokens, min_tokens, max_tokens
and stop strings; and the drafts do get accepted (the speedup is real work saved)."""

from __future__ import annotations

import re

import pytest
import torch

from llmfleet.client.llm import LLM
from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig
from llmfleet.shared.core.structured_output import StructuredOutput

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32)


def engine_with(loaded, k: int | None = 3, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
    cfg.update(kw)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k) if k else None
    return LLMEngine(EngineConfig(speculative=spec, **cfg), loaded)


def repetitive_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase (so prompt lookup finds matches), and a few
    plain random ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab - 4, (int(3 + i % 4),), generator=g).tolist()
        if i % 3 == 2:
            out.append(torch.randint(3, vocab - 4, (13,), generator=g).tolist())
        else:
            out.append(phrase * (2 + i % 3) + phrase[:1])
    return out


def drain(engine: LLMEngine, prompts, params):
    """{(request id, index): tokens} and {(request id, index): finish reason}."""
    tokens: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finished:
                finish[(o.request_id, o.index)] = o.finish_reason
    return tokens, finish


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_greedy_equal_on_every_architecture(make_checkpoint_module, arch):
    arch_loaded = load_model(str(make_checkpoint_module(arch)), dtype=torch.float32)
    prompts = repetitive_prompts(arch_loaded.spec.vocab_size, 3)
    ref, ref_finish = drain(engine_with(arch_loaded, k=None), prompts, GREEDY)
    engine = engine_with(arch_loaded, k=3)
    got, got_finish = drain(engine, prompts, GREEDY)
    assert got == ref
    assert got_finish == ref_finish
    stats = engine.spec_stats
    assert stats.num_accepted > 0  # drafts were kept: the equality is not vacuous
    assert stats.num_accepted < stats.num_emitted <= sum(len(t) for t in got.values())
    assert engine.num_free_blocks == 256  # every block came back, rejected slots included


@pytest.mark.parametrize(("batch", "k"), [(1, 1), (4, 3), (8, 5), (1, 5)])
def test_greedy_equal_across_batch_sizes_and_draft_lengths(loaded, batch, k):
    prompts = repetitive_prompts(loaded.spec.vocab_size, batch, seed=batch)
    ref, _ = drain(engine_with(loaded, k=None), prompts, GREEDY)
    engine = engine_with(loaded, k=k)
    got, _ = drain(engine, prompts, GREEDY)
    assert got == ref
    stats = engine.spec_stats
    assert stats.num_accepted > 0
    assert len(stats.accepted_by_position) == k
    assert sum(stats.accepted_by_position) == stats.num_accepted
    # Acceptance by position falls off: a draft is kept only if those before it were.
    assert stats.accepted_by_position == sorted(stats.accepted_by_position, reverse=True)


def test_per_request_counters_and_outputs(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 2)
    engine = engine_with(loaded, k=4)
    last = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    multi_token_steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            last[o.request_id] = o
            multi_token_steps += len(o.new_token_ids) > 1
    assert multi_token_steps > 0
    drafted = sum(o.num_draft_tokens for o in last.values())
    accepted = sum(o.num_accepted_tokens for o in last.values())
    assert drafted == engine.spec_stats.num_drafted
    assert 0 < accepted == engine.spec_stats.num_accepted
    assert all(o.num_output_tokens == 32 for o in last.values())


def test_greedy_equal_with_preemption(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 5, seed=3)
    ref, _ = drain(engine_with(loaded, k=None), prompts, GREEDY)
    # 14 blocks of 4 tokens: the requests need up to 15 blocks each, so they cannot all run.
    tiny = engine_with(loaded, k=3, num_kv_blocks=16)
    got, _ = drain(tiny, prompts, GREEDY)
    assert tiny.scheduler.num_preemptions_total > 0
    assert tiny.spec_stats.num_accepted > 0
    assert got == ref
    assert tiny.num_free_blocks == 16


def test_greedy_equal_with_a_small_token_budget(loaded):
    # 8 tokens per step for 6 decoding sequences: drafts are trimmed to the budget left.
    prompts = repetitive_prompts(loaded.spec.vocab_size, 6, seed=4)
    ref, _ = drain(engine_with(loaded, k=None), prompts, GREEDY)
    engine = engine_with(loaded, k=5, max_num_batched_tokens=8, block_size=8, num_kv_blocks=128)
    got, _ = drain(engine, prompts, GREEDY)
    assert got == ref
    assert engine.spec_stats.num_accepted > 0


def test_n2_equal(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 2, seed=5)
    params = SamplingParams(n=2, max_tokens=30, temperature=0.0, ignore_eos=True)
    ref, _ = drain(engine_with(loaded, k=None), prompts, params)
    engine = engine_with(loaded, k=3)
    got, _ = drain(engine, prompts, params)
    assert set(got) == {(f"r{i}", j) for i in range(2) for j in range(2)}
    assert got == ref
    assert engine.spec_stats.num_accepted > 0


def test_stop_tokens_min_tokens_and_max_tokens(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 4, seed=6)
    ref, _ = drain(engine_with(loaded, k=None), prompts, GREEDY)
    # Stop ids the sequences produce mid-way (each sequence's 5th and 9th tokens), so a
    # verified step can hit one among its kept drafts.
    stops = tuple(sorted({toks[4] for toks in ref.values()} | {toks[8] for toks in ref.values()}))
    cases = [
        SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=stops, ignore_eos=True),
        SamplingParams(
            max_tokens=32, min_tokens=7, temperature=0.0, stop_token_ids=stops, ignore_eos=True
        ),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ]
    results = []
    for params in cases:
        want = drain(engine_with(loaded, k=None), prompts, params)
        got = drain(engine_with(loaded, k=4), prompts, params)
        assert got == want, params
        results.append(got)
    assert "stop" in results[0][1].values()
    assert "stop" in results[1][1].values()
    assert all(len(t) >= 7 for t in results[1][0].values())
    assert all(len(t) == 2 for t in results[2][0].values())


def test_opted_out_and_ineligible_requests_get_no_drafts(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 2)
    for params in (
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, speculative=False),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.5),
    ):
        ref = drain(engine_with(loaded, k=None), prompts, params)
        engine = engine_with(loaded, k=3)
        assert drain(engine, prompts, params) == ref
        assert engine.spec_stats.num_drafted == 0


def test_disable_batch_size(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 4)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, disable_batch_size=2)
    cfg = EngineConfig(block_size=4, num_kv_blocks=256, speculative=spec)
    engine = LLMEngine(cfg, loaded)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = drain(engine, prompts, params)
    assert got == drain(engine_with(loaded, k=None), prompts, params)
    assert engine.spec_stats.num_drafted == 0  # 4 sequences ran: over the threshold
    one = LLMEngine(cfg, loaded)
    drain(one, prompts[:1], params)
    assert one.spec_stats.num_accepted > 0


def test_stop_string_through_llm(loaded):
    prompts = repetitive_prompts(loaded.spec.vocab_size, 3, seed=8)
    plain = LLM(EngineConfig(block_size=4, num_kv_blocks=256), loaded=loaded)
    [ref] = plain.generate([prompts[0]], GREEDY)
    text = ref.completions[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate(prompts, params)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    fast = LLM(EngineConfig(block_size=4, num_kv_blocks=256, speculative=spec), loaded=loaded)
    got = fast.generate(prompts, params)
    assert [r.completions for r in got] == [r.completions for r in want]
    assert got[0].completions[0].finish_reason == "stop"
    assert got[0].completions[0].stop_string == stop
    assert fast.engine.spec_stats.num_accepted > 0
    assert fast.engine.num_free_blocks == 256


def test_mixed_batch_of_drafted_and_plain_sequences(loaded):
    """Sequences with logprobs, penalties or a grammar share steps with drafted ones: every
    sequence's tokens and logprobs are those of the run without drafts."""
    prompts = repetitive_prompts(loaded.spec.vocab_size, 4, seed=9)
    regex = StructuredOutput("regex", "(ab|ba)+c")
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=20, temperature=0.0, structured_output=regex),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=0.3),
    ]

    def run(k):
        engine = engine_with(loaded, k=k)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        out: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(4)}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend(o.new_logprobs)
        return out, engine

    ref, _ = run(None)
    got, engine = run(4)
    assert engine.spec_stats.num_accepted > 0
    for rid in ref:
        assert got[rid][0] == ref[rid][0], rid
    for a, b in zip(got["r1"][1], ref["r1"][1], strict=True):
        assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    text = bytes(t for t in got["r2"][0] if t < 256).decode()
    assert re.fullmatch("(ab|ba)+c?", text), text  # the grammar held (max_tokens may end it)
