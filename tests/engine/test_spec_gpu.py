"""Speculative decoding on a GPU: every decode step replays the CUDA graphs, a verification
step with its drafts as extra decode rows; greedy output with n-gram drafts equals the output
without them (float32), and a bf16 SmolLM2 copying text keeps most drafts."""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

pytestmark = pytest.mark.gpu

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. Knowledge is power, and time is money."
)


def run(loaded, prompts, params, spec, **kw):
    cfg = EngineConfig(device="cuda", dtype=kw.pop("dtype", "float32"), speculative=spec, **kw)
    engine = LLMEngine(cfg, loaded)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, engine


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_equal_on_cuda(make_checkpoint_module, arch):
    loaded = load_model(str(make_checkpoint_module(arch)), dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() * 3 for n in (4, 5, 7, 3)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref, plain = run(loaded, prompts, params, None, block_size=16, num_kv_blocks=256)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    got, engine = run(loaded, prompts, params, spec, block_size=16, num_kv_blocks=256)
    assert plain.runner.decode_graphs is not None
    assert got == ref
    # Verification steps replayed the decode graphs too (drafts as extra rows).
    assert engine.runner.decode_graphs.num_replays >= engine.spec_stats.num_steps > 0
    assert engine.spec_stats.num_accepted > 0
    assert engine.num_free_blocks == 256


def test_bundled_bf16_copy_keeps_most_drafts():
    loaded = load_model(None, dtype=torch.bfloat16, device="cuda", progress=False)
    tok = loaded.tokenizer
    msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else list(ids["input_ids"])
    params = SamplingParams(max_tokens=48, temperature=0.0)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    got, engine = run(loaded, [ids], params, spec, dtype="bfloat16")
    stats = engine.spec_stats
    assert stats.num_accepted / stats.num_drafted > 0.5
    assert stats.num_emitted > 2 * stats.num_steps  # > 2 tokens per verified step
    text = tok.decode(got["r0"], skip_special_tokens=True)
    assert "quick brown fox" in text
