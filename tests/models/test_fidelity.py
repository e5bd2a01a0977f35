"""Our models vs transformers on tiny random checkpoints of every architecture (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    ARCHS,
    PROMPT_LENS,
    Runner,
    assert_logits_close,
    build_hf_model,
    hf_logits,
    random_prompts,
    save_checkpoint,
)

from llmfleet.models.loader import load_model
from llmfleet.shared.core.errors import ModelLoadError


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    hf = build_hf_model(arch)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(arch) / arch)
    return arch, hf, load_model(str(path), progress=False)


def test_prefill_matches_transformers(arch_pair) -> None:
    _, hf, loaded = arch_pair
    prompts = random_prompts(loaded.spec.vocab_size)
    runner = Runner(loaded, PROMPT_LENS)
    ours = runner.step(prompts, [0, 0, 0])
    for o, r in zip(ours, hf_logits(hf, prompts), strict=True):
        assert_logits_close(o, r)


def test_chunked_prefill_matches(arch_pair) -> None:
    _, hf, loaded = arch_pair
    prompts = random_prompts(loaded.spec.vocab_size)
    runner = Runner(loaded, PROMPT_LENS)
    splits = [2, 8, 9]  # second chunks start mid-block and on a block boundary
    runner.step([p[:s] for p, s in zip(prompts, splits, strict=True)], [0, 0, 0])
    ours = runner.step([p[s:] for p, s in zip(prompts, splits, strict=True)], splits)
    for o, r, s in zip(ours, hf_logits(hf, prompts), splits, strict=True):
        assert_logits_close(o, r[s:])


def test_decode_step_matches(arch_pair) -> None:
    _, hf, loaded = arch_pair
    prompts = random_prompts(loaded.spec.vocab_size)
    runner = Runner(loaded, PROMPT_LENS)
    runner.step([p[:-1] for p in prompts], [0, 0, 0])
    ours = runner.step([p[-1:] for p in prompts], [n - 1 for n in PROMPT_LENS])  # pure decode
    for o, r in zip(ours, hf_logits(hf, prompts), strict=True):
        assert_logits_close(o[0], r[-1])


def test_model_info(arch_pair) -> None:
    arch, _, loaded = arch_pair
    info = loaded.spec
    assert info.model_id == arch
    assert info.vocab_size == 260 and info.hidden_size == 64
    assert info.eos_token_ids[0] == 256
    assert 258 in info.eos_token_ids  # <|im_end|>: the chat template's end of turn
    assert info.bos_token_id == 256
    assert loaded.tokenizer.decode(loaded.tokenizer("héllo").input_ids) == "héllo"


def test_sharded_checkpoint_loads_same_logits(tmp_path: Path) -> None:
    hf = build_hf_model("llama")
    whole = load_model(str(save_checkpoint(hf, tmp_path / "whole")), progress=False)
    path = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    sharded = load_model(str(path), progress=False)
    for (name, a), (_, b) in zip(
        whole.model.state_dict().items(), sharded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_bf16_runs_close_to_fp32(tmp_path: Path) -> None:
    path = save_checkpoint(build_hf_model("qwen3"), tmp_path / "qwen3")
    prompts = random_prompts(260)
    ref = Runner(load_model(str(path), progress=False), PROMPT_LENS).step(prompts, [0, 0, 0])
    loaded = load_model(str(path), dtype=torch.bfloat16, progress=False)
    runner = Runner(loaded, PROMPT_LENS)
    runner.kv = [c.bfloat16() for c in runner.kv]
    for o, r in zip(runner.step(prompts, [0, 0, 0]), ref, strict=True):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, r, atol=0.05 * r.abs().max().item(), rtol=0.05)


def test_unsupported_architecture_is_a_load_error(tmp_path: Path) -> None:
    path = save_checkpoint(build_hf_model("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(path), progress=False)


def test_missing_files_are_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), progress=False)
    path = save_checkpoint(build_hf_model("llama"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(path), progress=False)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(path), progress=False)
