"""`--load-format dummy`: a checkpoint directory's config and tokenizer with random weights, no
weight file read. The model is the one its config describes (same KV geometry, the same
weights `random_model` draws), it runs, and a directory without weights is enough."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import load_model, random_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ModelLoadError, ValidationError


@pytest.fixture(scope="module")
def dirs(make_checkpoint_module, tmp_path_factory):
    """A tiny checkpoint, and a copy of it without its weight files."""
    full = make_checkpoint_module("qwen2")
    bare = tmp_path_factory.mktemp("bare")
    for f in full.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, bare / f.name)
    return full, bare


def test_dummy_load_needs_no_weights_and_matches_the_config(dirs):
    full, bare = dirs
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(bare), progress=False)
    real = load_model(str(full), progress=False)
    dummy = load_model(str(bare), progress=False, load_format="dummy")
    assert dummy.spec == dataclasses.replace(real.spec, model_id=bare.name)
    assert dummy.tokenizer is not None and len(dummy.tokenizer) == len(real.tokenizer)
    # Random, not the checkpoint's: the file was never read.
    assert not torch.equal(dummy.model.lm_head.weight, real.model.lm_head.weight)


def test_dummy_weights_are_random_models_and_run(dirs):
    _, bare = dirs
    dummy = load_model(str(bare), progress=False, load_format="dummy")
    again = random_model(dummy.model.config)
    for (name, p), (_, q) in zip(
        dummy.model.named_parameters(), again.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    spec = dummy.spec
    shape = (2, 4, 4, spec.num_kv_heads, spec.head_dim)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([3], [3], [[0]], 4, torch.device("cpu"))
    hidden = dummy.model(torch.tensor([5, 6, 7]), torch.arange(3), caches, meta)
    logits = dummy.model.compute_logits(hidden)
    assert logits.shape == (3, spec.vocab_size) and torch.isfinite(logits).all()


def test_load_format_is_validated():
    with pytest.raises(ValidationError) as e:
        EngineConfig(load_format="pt")
    assert e.value.field == "load_format"
