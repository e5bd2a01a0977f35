"""The end-to-end GPU benchmark's code paths, run in its `--tiny` mode on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from llmfleet.models.loader import build_model, random_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e_llama3_bench.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # its sibling decode_timing.py
    spec = importlib.util.spec_from_file_location("e2e_llama3_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_random_model_is_seeded_and_needs_no_tokenizer(bench) -> None:
    config = bench.TINY.config
    a = random_model(config, seed=3)
    b = random_model(config, seed=3)
    c = random_model(config, seed=4)
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    assert torch.equal(pa["norm.weight"], torch.ones_like(pa["norm.weight"]))
    assert a.tokenizer is None and a.spec.eos_token_ids == ()
    assert a.spec.num_kv_heads == 2 and a.spec.vocab_size == 512


def test_llama3_8b_shape_byte_counts(bench) -> None:
    config = bench.llama3_8b_config()
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - 8.03e9) < 0.01e9  # Llama-3-8B's parameter count
    # every parameter but the 128256 x 4096 input embedding, in bf16
    assert bench.weight_bytes_per_step(model) == 2 * (params - 128256 * 4096)


def test_tiny_run_reports_every_figure(bench) -> None:
    plan = bench.TINY
    r = bench.run(plan, offline_limit_s=60.0, log=lambda _: None)
    assert r.copy_bw > 0 and r.kv_per_token == 2 * 2 * 2 * 16 * 4
    assert set(r.ours) == set(r.roofline) == set(r.hf)
    assert all(v > 0 for d in (r.ours, r.roofline, r.hf) for v in d.values())
    o = r.offline
    assert o.finished == o.requests == plan.offline_requests
    assert plan.offline_lo * o.requests <= o.output_tokens <= plan.offline_hi * o.requests
    text = bench.table(r, plan)
    assert "decode b=4 ctx~43" in text and "PARTIAL" not in text


def test_offline_limit_reports_partial(bench) -> None:
    engine, _ = bench.build_engine(bench.TINY)
    o = bench.offline_throughput(engine, bench.TINY, limit_s=0.0)
    assert o.finished == 0 and o.output_tokens == 0 and o.steps == 0


def test_tied_head_reads_the_whole_table(bench) -> None:
    config = bench.llama3_8b_config(tie_word_embeddings=True)
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    assert bench.weight_bytes_per_step(model) == 2 * sum(p.numel() for p in model.parameters())
