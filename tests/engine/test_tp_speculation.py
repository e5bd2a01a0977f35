"""Speculative decoding in a tensor-parallel worker: rank 0 drafts (n-gram) and its
verification steps carry the drafts as rows to the follower, which runs without a proposer of
its own (its config arrives without speculation); greedy tokens equal TP=1 without drafts."""

from __future__ import annotations

import torch
from test_tp_engine import CFG, drain, engine, prompts

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.speculative import SpeculativeConfig


def test_tp2_with_ngram_drafts_gives_the_tp1_tokens(make_checkpoint_module):
    path = make_checkpoint_module(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3
    )
    # Most of the vocabulary in one prompt: whatever the random model says appeared before,
    # so the lookup drafts at every step (the drafts then mostly fail: random weights).
    wide = torch.randperm(240, generator=torch.Generator().manual_seed(3)).add(3).tolist()[:200]
    batch = [("r", wide), ("s", prompts([11], seed=4)[0] * 3)]
    want = drain(engine(path, 1), batch)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    config = EngineConfig(model=str(path), tensor_parallel_size=2, speculative=spec, **CFG)
    drafting = LLMEngine(config, load_for(config))
    try:
        assert drain(drafting, batch) == want
        stats = drafting.spec_stats
        assert stats.num_steps > 0 and stats.num_drafted > 0
    finally:
        drafting.close()
