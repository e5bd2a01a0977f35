"""The simulated model (`EngineConfig(simulate=True)`) in the real engine: the bundled model's
tokenizer and KV geometry, a step-time model for its forward pass, a deterministic next token."""

from __future__ import annotations

import dataclasses
import time

import pytest

from llmfleet.client.llm import LLM
from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.models.simulated import StepTime
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams

FAST = EngineConfig(
    simulate=True, sim_step_ms=0, sim_decode_ms_per_seq=0, sim_prefill_ms_per_token=0
)


@pytest.fixture(scope="module")
def loaded():
    return load_for(FAST)


def _engine(loaded, **overrides) -> LLMEngine:
    return LLMEngine(dataclasses.replace(FAST, **overrides), loaded)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams):
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return out, reasons


def test_step_time_model():
    st = StepTime(step_ms=2.0, decode_ms_per_seq=0.5, prefill_ms_per_token=0.25)
    # three sequences decoding one token each, one 8-token prompt chunk
    assert st.seconds([1, 1, 1, 8]) == pytest.approx((2.0 + 3 * 0.5 + 8 * 0.25) / 1e3)
    assert st.seconds([]) == pytest.approx(0.002)


def test_spec_is_the_checkpoints_and_blocks_follow_its_kv_geometry(loaded):
    assert loaded.spec.architecture == "Simulated"
    assert loaded.spec.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert loaded.tokenizer is not None and loaded.spec.eos_token_ids
    engine = _engine(loaded, kv_cache_bytes=1 << 30)
    s = loaded.spec
    bytes_per_block = 2 * 16 * s.num_kv_heads * s.head_dim * 4 * s.num_layers
    assert engine.block_manager.num_blocks == (1 << 30) // bytes_per_block
    assert engine.kv.block_shape == (1, 2, 16, 1, 1)  # blocks are real but carry no data


def test_requests_run_to_their_length_with_ordinary_deterministic_tokens(loaded):
    engine = _engine(loaded)
    prompts = {f"r{i}": [5 + i] * (10 + 7 * i) for i in range(6)}
    a, reasons = _run(engine, prompts, SamplingParams(max_tokens=24, temperature=0.9))
    b, _ = _run(_engine(loaded), prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert a == b  # one-hot: sampling and greedy agree
    special = set(loaded.tokenizer.all_special_ids) | set(loaded.spec.eos_token_ids)
    for rid, tokens in a.items():
        assert len(tokens) == 24 and reasons[rid] == "length"
        assert not special & set(tokens)
    assert len({tuple(t) for t in a.values()}) == len(a)  # different prompts, different text
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_are_those_of_a_one_hot_distribution(loaded):
    engine = _engine(loaded)
    engine.add_request("r", [7] * 12, SamplingParams(max_tokens=3, logprobs=5))
    lps = []
    while engine.has_unfinished():
        for o in engine.step():
            lps += o.new_logprobs
    assert [(lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs) for lp in lps] == [
        (0.0, 1, [lp.token_id], [0.0]) for lp in lps
    ]


def test_stop_token_ids_end_a_completion_after_min_tokens(loaded):
    engine = _engine(loaded)
    free, _ = _run(engine, {"r": [9] * 20}, SamplingParams(max_tokens=8))
    first = free["r"][0]
    out, reasons = _run(
        _engine(loaded), {"r": [9] * 20}, SamplingParams(max_tokens=8, stop_token_ids=[first])
    )
    assert out["r"] == [first] and reasons["r"] == "stop"
    out, reasons = _run(
        _engine(loaded),
        {"r": [9] * 20},
        SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[first]),
    )
    assert out["r"][0] != first and len(out["r"]) >= 2


def test_a_step_takes_the_modelled_time(loaded):
    engine = _engine(
        loaded, sim_step_ms=30.0, sim_decode_ms_per_seq=5.0, sim_prefill_ms_per_token=0
    )
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i] * 8, SamplingParams(max_tokens=3))
    engine.step()  # the prompts
    start = time.perf_counter()
    engine.step()  # four sequences decode one token each
    assert time.perf_counter() - start >= (30.0 + 4 * 5.0) / 1e3


def test_kv_blocks_export_and_import(loaded):
    engine = _engine(loaded)
    _run(engine, {"r": list(range(3, 3 + 40))}, SamplingParams(max_tokens=2))
    hashes = engine.kv.cached_block_hashes()
    read = engine.kv.start_export("put", hashes)
    assert read is not None and read.done()  # off CUDA the copy is made at once
    payload = read.wait()
    engine.kv.end_export("put")
    assert tuple(payload.shape) == (len(hashes), 1, 2, 16, 1, 1)
    other = _engine(loaded)
    assert other.kv.import_cached_blocks(hashes, payload) == len(hashes)


def test_offline_llm_streams_text(loaded):
    llm = LLM(FAST, loaded=loaded)
    [res] = llm.generate(["Hello"], SamplingParams(max_tokens=10), chat=True)
    assert len(res.completions[0].token_ids) == 10 and res.completions[0].text


@pytest.mark.parametrize("field, value", [("sim_step_ms", -1.0), ("sim_decode_ms_per_seq", 1e9)])
def test_bad_simulation_settings_name_the_field(field, value):
    with pytest.raises(ValidationError, match=f"^{field}"):
        EngineConfig(simulate=True, **{field: value})
    with pytest.raises(ValidationError, match="^quantization"):
        EngineConfig(simulate=True, device="cuda", dtype="bfloat16", quantization="fp8")


def test_a_virtual_clock_can_take_the_steps_time(loaded):
    """A virtual-time harness (benchmarks/virtual_fleet.py) replaces the runner's sleep."""
    engine = _engine(loaded, sim_step_ms=30.0, sim_decode_ms_per_seq=5.0)
    took: list[float] = []
    engine.runner.sleep = took.append
    engine.add_request("r", [3] * 8, SamplingParams(max_tokens=2))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    assert time.perf_counter() - start < 0.03  # nothing slept
    assert took == pytest.approx([0.030, 0.035])  # the prompt's step, then one decode step
