"""Decode steps replayed from CUDA graphs give the eager engine's greedy tokens.

Run on the GPU machine: `pytest -m gpu -s tests/engine/test_cuda_graphs.py` (-s shows the
per-step timings).
"""

from __future__ import annotations

import time

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import LoadedModel, load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
STEPS = 32
BATCHES = (1, 3, 17)
CFG = dict(
    device="cuda", block_size=16, num_kv_blocks=256, max_num_seqs=64, max_num_batched_tokens=2048
)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy tokens of each prompt, and the median wall time of the pure-decode steps (ms)."""
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    times = []
    while engine.has_unfinished():
        decode = engine.scheduler.running and not engine.scheduler.waiting
        start = time.perf_counter()
        outputs = engine.step()  # the sampler's .tolist() waits for the GPU
        if decode:
            times.append(time.perf_counter() - start)
        for o in outputs:
            out[o.request_id].extend(o.new_token_ids)
    times.sort()
    return [out[f"r{i}"] for i in range(len(prompts))], 1e3 * times[len(times) // 2]


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module) -> dict[str, LoadedModel]:
    return {
        arch: load_model(str(make_checkpoint_module(arch)), device="cuda", progress=False)
        for arch in ("llama", "qwen3_moe")
    }


def ragged_prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(2, 90, (n,), generator=g).tolist()  # >= 2: prefill is not decode
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_graphs_give_eager_tokens(arch, loaded):
    """Eager steps, graph replays waited on one by one (async scheduling off), and replays
    chained from the previous step's tokens on the device: the same greedy tokens."""
    model = loaded[arch]
    eager = LLMEngine(EngineConfig(cuda_graph_max_batch_size=0, **CFG), model)
    synced = LLMEngine(EngineConfig(async_scheduling=False, **CFG), model)
    graphed = LLMEngine(EngineConfig(**CFG), model)
    assert eager.runner.decode_graphs is None
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    rows = []
    for batch in BATCHES:
        prompts = ragged_prompts(model.spec.vocab_size, batch)
        want, eager_ms = greedy(eager, prompts)
        got_sync, sync_ms = greedy(synced, prompts)
        replays, chained = graphs.num_replays, graphed.chain.num_chained_steps
        got, graph_ms = greedy(graphed, prompts)
        assert got_sync == want, f"batch {batch}"
        assert got == want, f"batch {batch}"
        assert all(len(t) == STEPS for t in got)
        # One prefill step (every prompt fits the token budget), then STEPS - 1 replays, all
        # but the first launched ahead of the previous step's read-back.
        assert graphs.num_replays - replays == STEPS - 1
        assert graphed.chain.num_chained_steps - chained == STEPS - 2
        rows.append(
            f"{arch} batch {batch:2d}: eager {eager_ms:.2f} ms, graphs {sync_ms:.2f} ms, "
            f"graphs + async scheduling {graph_ms:.2f} ms"
        )
    assert synced.chain.num_chained_steps == 0
    assert graphed.num_free_blocks == synced.num_free_blocks == eager.num_free_blocks == 256
    print("\ndecode step (median, engine.step incl. scheduling and sampling)")
    print("\n".join(rows))


def test_batches_above_the_max_run_eagerly(loaded):
    model = loaded["llama"]
    prompts = ragged_prompts(model.spec.vocab_size, 17)
    want, _ = greedy(LLMEngine(EngineConfig(cuda_graph_max_batch_size=0, **CFG), model), prompts)
    engine = LLMEngine(EngineConfig(cuda_graph_max_batch_size=16, **CFG), model)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes[-1] == 16
    got, _ = greedy(engine, prompts)
    assert got == want
    assert graphs.num_replays == 0
    got, _ = greedy(engine, prompts[:16])
    assert got == want[:16]
    # STEPS - 1 decode steps; the prefill step too when prefix-cache hits leave one token each.
    assert STEPS - 1 <= graphs.num_replays <= STEPS


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_graph_logits_close_to_eager(arch, make_checkpoint_module):
    """bf16 (Triton fused MoE for qwen3_moe): padding changes the matmul shapes, so the logits
    agree to bf16 rounding, not bit for bit."""
    model = load_model(
        str(make_checkpoint_module(arch)), dtype=torch.bfloat16, device="cuda", progress=False
    )
    engine = LLMEngine(EngineConfig(dtype="bfloat16", **CFG), model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ragged_prompts(model.spec.vocab_size, 5)):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # prefill
    sched = engine.scheduler.schedule()
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    replayed = runner.execute(sched).logits.clone()
    assert graphs.num_replays == 1
    runner.decode_graphs = None
    try:
        eager = runner.execute(sched).logits
    finally:
        runner.decode_graphs = graphs
    assert replayed.shape == eager.shape == (5, model.spec.vocab_size)
    scale = eager.abs().max().item()
    assert (replayed - eager).abs().max().item() <= 0.02 * scale


def test_bf16_skinny_gemm_decode_close_to_cublas(make_checkpoint_module, monkeypatch):
    """Decode batches of 2..64 rows run the skinny GEMM where the tuned file says so (the tiny
    model's shapes are not in it: here every shape is sent to it). Its graphs give the first
    decode step's logits of an engine on cuBLAS, to bf16 rounding."""
    from llmfleet.kernels import skinny_gemm as sg

    model = load_model(
        str(make_checkpoint_module("llama")), dtype=torch.bfloat16, device="cuda", progress=False
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    logits = []
    calls = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(
                sg,
                "choose",
                lambda m, n, k, *_, gated=False: (
                    calls.append(m) or sg.default_config(m, n // 2 if gated else n, k, gated)
                ),
            )
        engine = LLMEngine(EngineConfig(dtype="bfloat16", **CFG), model)
        for i, p in enumerate(ragged_prompts(model.spec.vocab_size, 5)):
            engine.add_request(f"r{i}", p, params)
        engine.step()  # prefill
        sched = engine.scheduler.schedule()
        logits.append(engine.runner.execute(sched).logits.clone())
        assert engine.runner.decode_graphs is not None
        assert engine.runner.decode_graphs.num_replays == 1
    assert calls and set(calls) <= set(range(2, 65))  # captured graphs went through it
    cublas, skinny = logits
    assert skinny.shape == cublas.shape == (5, model.spec.vocab_size)
    assert (skinny - cublas).abs().max().item() <= 0.02 * cublas.abs().max().item()
