"""Greedy generation through the whole engine equals transformers, for every architecture.

Tiny random-weight checkpoints (made by the tests, saved as real HF safetensors) run through
the engine with small blocks and a small token budget, so prompts are chunked, blocks span
boundaries, sequences batch continuously, and a second round hits the prefix cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

ARCHS = ["llama", "llama3_rope", "qwen2", "qwen3", "mixtral", "qwen3_moe"]
STEPS = 32


def run_engine(engine: LLMEngine, prompts, params, prefix="r"):
    outs = {f"{prefix}{i}": [] for i in range(len(prompts))}
    cached = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
    return [outs[f"{prefix}{i}"] for i in range(len(prompts))], [
        cached[f"{prefix}{i}"] for i in range(len(prompts))
    ]


def hf_greedy(path, prompts, steps):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            res.append(out[0, len(p) :].tolist())
    return res


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_batched_chunked_and_cached(arch, make_checkpoint, tmp_path):
    path = make_checkpoint(arch, tmp_path)
    loaded = load_model(str(path), dtype=torch.float32)
    vocab = loaded.spec.vocab_size
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19, 42)]
    expected = hf_greedy(path, prompts, STEPS)

    config = EngineConfig(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    engine = LLMEngine(config, loaded)
    free0 = engine.num_free_blocks
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    got, cached = run_engine(engine, prompts, params)
    assert got == expected
    assert cached == [0, 0, 0]
    # Second round: same prompts again, now mostly served from the prefix cache.
    got2, cached2 = run_engine(engine, prompts, params, prefix="again")
    assert got2 == expected
    assert cached2 == [4, 16, 40]  # whole blocks, always leaving >= 1 token to compute
    assert engine.num_free_blocks == free0
