"""Paging through the engine: prefix hits, preemption, abort, free-block accounting, n > 1."""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32)


def engine_with(loaded, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded)


def prompts(loaded, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, loaded.spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def drain(engine, ids_prompts, params):
    outs = {rid: {} for rid, _ in ids_prompts}
    finish = {}
    for rid, p in ids_prompts:
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].setdefault(o.index, []).extend(o.new_token_ids)
            if o.finished:
                finish[(o.request_id, o.index)] = o.finish_reason
    return outs, finish


def test_preemption_under_tiny_block_budget_gives_identical_outputs(loaded):
    ps = prompts(loaded, [9, 14, 11, 7])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    big = engine_with(loaded)
    ref, _ = drain(big, [(f"r{i}", p) for i, p in enumerate(ps)], params)
    # 12 blocks of 4 tokens: each request needs up to 10 blocks, so they cannot all run.
    tiny = engine_with(loaded, num_kv_blocks=12)
    got, _ = drain(tiny, [(f"r{i}", p) for i, p in enumerate(ps)], params)
    assert tiny.scheduler.num_preemptions_total > 0
    assert big.scheduler.num_preemptions_total == 0
    assert got == ref
    assert tiny.num_free_blocks == 12


def test_seeded_sampling_survives_preemption(loaded):
    ps = prompts(loaded, [9, 14, 11], seed=5)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=42, ignore_eos=True)
    ref, _ = drain(engine_with(loaded), [(f"r{i}", p) for i, p in enumerate(ps)], params)
    tiny = engine_with(loaded, num_kv_blocks=10)
    got, _ = drain(tiny, [(f"r{i}", p) for i, p in enumerate(ps)], params)
    assert tiny.scheduler.num_preemptions_total > 0
    assert got == ref


def test_prefix_hits_are_reported(loaded):
    engine = engine_with(loaded)
    [p] = prompts(loaded, [30])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("a", p, params)
    first = [o for _ in range(50) for o in engine.step()]
    assert first[-1].finished and first[-1].num_cached_tokens == 0
    engine.add_request("b", p + [5, 6, 7], params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].num_cached_tokens == 28  # 7 full blocks of 4
    assert engine.block_manager.stats.num_hits >= 28


def test_abort_at_any_point_returns_every_block(loaded):
    engine = engine_with(loaded, max_num_batched_tokens=8)
    free0 = engine.num_free_blocks
    ps = prompts(loaded, [20, 20, 20], seed=3)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # r0 is mid-prefill (chunked), r1/r2 waiting
    assert engine.abort("r0")
    assert engine.abort("r2")  # still queued
    for _ in range(8):
        engine.step()  # r1 decoding
    assert engine.abort("r1")
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {"abort"}
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == free0
    assert not engine.abort("r1") and not engine.abort("unknown")


def test_completion_returns_every_block(loaded):
    engine = engine_with(loaded)
    free0 = engine.num_free_blocks
    ps = prompts(loaded, [5, 33, 12], seed=9)
    _, finish = drain(
        engine,
        [(f"r{i}", p) for i, p in enumerate(ps)],
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    )
    assert set(finish.values()) == {"length"}
    assert engine.num_free_blocks == free0


def test_n_greater_than_one_shares_prompt_blocks(loaded):
    engine = engine_with(loaded)
    [p] = prompts(loaded, [40], seed=11)
    params = SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("multi", p, params)
    peak_used = 0
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.index, []).extend(o.new_token_ids)
        peak_used = max(peak_used, 256 - engine.num_free_blocks)
    # Greedy: the three completions are identical; prompt blocks (10) are held once.
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 6
    assert peak_used <= 10 + 3 * 2
    assert engine.num_free_blocks == 256


def test_n_seeded_completions_differ_and_reproduce(loaded):
    [p] = prompts(loaded, [10], seed=12)
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a, _ = drain(engine_with(loaded), [("x", p)], params)
    b, _ = drain(engine_with(loaded), [("x", p)], params)
    assert a == b
    assert a["x"][0] != a["x"][1]


def test_stop_token_and_min_tokens(loaded):
    engine = engine_with(loaded)
    [p] = prompts(loaded, [6], seed=13)
    greedy, _ = drain(
        engine, [("g", p)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    tokens = greedy["g"][0]
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    outs, finish = drain(
        engine,
        [("s", p)],
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]),
    )
    assert outs["s"][0] == tokens[: first + 1]
    assert finish[("s", 0)] == "stop"


def test_validation_names_the_field(loaded):
    engine = engine_with(loaded)
    vocab = loaded.spec.vocab_size
    cases = [
        (lambda: engine.add_request("a", [], SamplingParams()), "prompt"),
        (lambda: engine.add_request("a", [1, vocab], SamplingParams()), "prompt_token_ids"),
        (lambda: engine.add_request("a", [1, -1], SamplingParams()), "prompt_token_ids"),
        (lambda: engine.add_request("a", [1], SamplingParams(n=1000)), "n"),
        (lambda: engine.add_request("a", [1], SamplingParams(logprobs=1000)), "logprobs"),
        (lambda: engine.add_request("a", [1], SamplingParams(max_tokens=10**6)), "max_tokens"),
        (
            lambda: engine.add_request("a", [1], SamplingParams(stop_token_ids=[vocab])),
            "stop_token_ids",
        ),
        (
            lambda: engine.add_request("a", [1], SamplingParams(stop_token_ids=[5] * 1025)),
            "stop_token_ids",
        ),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature=2.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_k=-2), "top_k"),
        (lambda: SamplingParams(min_p=1.5), "min_p"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(presence_penalty=3), "presence_penalty"),
        (lambda: SamplingParams(stop=[""]), "stop"),
    ]
    for call, field in cases:
        with pytest.raises(ValidationError) as e:
            call()
        assert e.value.field == field, (field, str(e.value))
    with pytest.raises(ValidationError, match=r"prompt \(3 tokens\) \+ max_tokens"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10**6))
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValidationError) as e:
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    assert e.value.field == "request_id"
    small = engine_with(loaded, num_kv_blocks=2)
    with pytest.raises(
        ValidationError,
        match=r"\(17 tokens\) \+ max_tokens \(4\) need 6 KV blocks; this worker.s whole cache",
    ):
        small.add_request("big", list(range(3, 20)), SamplingParams(max_tokens=4))
    assert small.num_free_blocks == 2


def test_engine_refuses_a_config_dtype_other_than_the_models(loaded):
    """The KV cache is made in the config's dtype; a model loaded in another would fail in
    the attention kernels instead."""
    with pytest.raises(ValidationError) as e:
        engine_with(loaded, dtype="bfloat16")
    assert e.value.field == "dtype" and "float32" in e.value.message
