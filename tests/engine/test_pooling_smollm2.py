"""Embeddings of the bundled SmolLM2 through the engine equal transformers' pooled hidden states
(the GGUF loaded by transformers; its base model's `last_hidden_state`), last and mean pooled."""

from __future__ import annotations

import pytest
from test_pooling import assert_embeddings_close, embed, engine_for, reference

from llmfleet.shared.core.pooling_params import PoolingParams

pytestmark = pytest.mark.slow


def test_bundled_model_equals_transformers(bundled_hf_model):
    engine = engine_for(None, max_num_batched_tokens=32, num_kv_blocks=64)
    hf = bundled_hf_model  # the session's one transformers load (tests/conftest.py)
    tok = engine.tokenizer
    texts = ["The capital of France is Paris.", "A hash function maps data to a fixed size."]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    for pooling in ("last", "mean"):
        ours = embed(engine, prompts, PoolingParams(pooling=pooling))
        assert_embeddings_close(ours, reference(hf.model, prompts, pooling))
