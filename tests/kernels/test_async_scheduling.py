"""Async scheduling: decode steps launched from the previous step's tokens on the device give
the synchronous engine's tokens, finish reasons and block counts, through stops, length
limits, seeded sampling, aborts and arrivals while a step is in flight.

The chained path needs a graph-safe decode path: CUDA graphs on a GPU; on the CPU the same
padded static-buffer path (`PaddedDecoder`) run eagerly through Triton's interpreter.
"""

from __future__ import annotations

import os
import re

import torch

# See test_attention_kernels.py: set before anything imports triton.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import prometheus_client  # noqa: E402
import pytest  # noqa: E402

from llmfleet.engine.cuda_graphs import PaddedDecoder  # noqa: E402
from llmfleet.engine.engine import LLMEngine  # noqa: E402
from llmfleet.models.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from llmfleet.models.loader import LoadedModel, load_model  # noqa: E402
from llmfleet.services.worker.outputs import StepMetrics  # noqa: E402
from llmfleet.shared.core.config import EngineConfig  # noqa: E402
from llmfleet.shared.core.sampling_params import SamplingParams  # noqa: E402
from llmfleet.shared.core.structured_output import StructuredOutput  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module) -> LoadedModel:
    backend = TritonAttentionBackend(force_triton=True)
    path = make_checkpoint_module("llama")
    return load_model(str(path), device=DEVICE, backend=backend, progress=False)


def make_engine(loaded: LoadedModel, async_scheduling: bool) -> LLMEngine:
    on_cuda = DEVICE == "cuda"
    cfg = EngineConfig(
        device=DEVICE,
        block_size=4,  # chained steps cross block boundaries and allocate
        num_kv_blocks=NUM_BLOCKS,
        cuda_graph_max_batch_size=4 if on_cuda else 0,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(cfg, loaded)
    if not on_cuda:
        engine.runner.decode_graphs = PaddedDecoder(
            loaded.model,
            engine.runner.kv_caches,
            max_batch_size=4,
            max_model_len=engine.max_model_len,
            vocab_size=loaded.spec.vocab_size,
        )
    return engine


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Tokens and finish reason of each request, all added at once."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return tokens, reasons


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 14, 6)]


def test_async_steps_give_the_synchronous_tokens(loaded) -> None:
    p = prompts()
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    # The stop token for r2: the third token it makes when nothing stops it.
    free_run, _ = run(make_engine(loaded, False), {"r2": (p[2], greedy)})
    requests = {
        "r0": (p[0], greedy),
        "r1": (p[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        "r2": (
            p[2],
            SamplingParams(
                max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[free_run["r2"][2]]
            ),
        ),
        "r3": (p[3], SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)),
    }
    sync = make_engine(loaded, False)
    want, want_reasons = run(sync, requests)
    engine = make_engine(loaded, True)
    got, reasons = run(engine, requests)

    assert got == want
    assert reasons == want_reasons == {"r0": "length", "r1": "length", "r2": "stop", "r3": "length"}
    assert [len(got[r]) for r in ("r0", "r1", "r3")] == [10, 3, 10]
    assert got["r2"][-1] == free_run["r2"][2] and len(got["r2"]) <= 3
    # Every decode step but the first of each run of them was chained.
    assert engine.chain.num_chained_steps >= 6
    assert sync.chain.num_chained_steps == 0
    assert engine.num_free_blocks == sync.num_free_blocks == NUM_BLOCKS


def test_structured_rows_chain_and_sample_the_synchronous_tokens(loaded) -> None:
    """Constrained rows decode chained too (their mask is filled from the pending tokens while
    the step runs): the same tokens as the synchronous engine, every output in its grammar,
    and a grammar that ends finishes its request with "stop" mid-chain."""
    p = prompts()
    word = StructuredOutput("regex", "[a-e]{4,12}")
    short = StructuredOutput("choice", choices=("abc", "bcd"))
    requests = {
        "r0": (
            p[0],
            SamplingParams(max_tokens=12, temperature=0.9, seed=3, structured_output=word),
        ),
        "r1": (p[1], SamplingParams(max_tokens=10, temperature=0.0, structured_output=short)),
        "r2": (p[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
    }
    want, want_reasons = run(make_engine(loaded, False), requests)
    engine = make_engine(loaded, True)
    got, reasons = run(engine, requests)

    assert got == want and reasons == want_reasons
    text = {rid: bytes(t for t in got[rid] if t < 256).decode() for rid in ("r0", "r1")}
    assert re.fullmatch("[a-e]{4,12}", text["r0"]) and text["r1"] in ("abc", "bcd")
    assert reasons["r1"] == "stop" and reasons["r2"] == "length"
    assert engine.chain.num_chained_steps >= 4
    assert engine.num_free_blocks == NUM_BLOCKS


def test_abort_and_arrival_while_a_step_is_in_flight(loaded) -> None:
    p = prompts()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = {}
    for rid, prompt in (("r0", p[0]), ("r1", p[1]), ("r2", p[2])):
        want[rid] = run(make_engine(loaded, False), {rid: (prompt, params)})[0][rid]

    engine = make_engine(loaded, True)
    engine.add_request("r0", p[0], params)
    engine.add_request("r1", p[1], params)
    got: dict[str, list[int]] = {"r0": [], "r1": [], "r2": []}
    reasons: dict[str, str | None] = {}

    def step() -> None:
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason

    while engine.chain.num_chained_steps < 3:
        step()
    assert engine.abort("r1")  # its row of the step in flight is dropped
    engine.add_request("r2", p[2], params)  # waits for the chain to break, then joins
    chained = engine.chain.num_chained_steps
    while engine.has_unfinished():
        step()

    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]
    assert 3 <= len(got["r1"]) < 12 and got["r1"] == want["r1"][: len(got["r1"])]
    assert reasons == {"r0": "length", "r1": "abort", "r2": "length"}
    assert engine.chain.num_chained_steps > chained  # chaining resumed after r2 joined
    assert engine.num_free_blocks == NUM_BLOCKS


def test_chained_steps_are_counted_for_prometheus(loaded) -> None:
    engine = make_engine(loaded, True)
    metrics = StepMetrics(engine)  # what the worker's engine loop updates after each step
    name = {"model_name": engine.spec.model_id}

    def count() -> float:
        sample = "llmfleet:engine_chained_steps_total"
        return prometheus_client.REGISTRY.get_sample_value(sample, name) or 0.0

    before = count()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompts()[0], params)
    while engine.has_unfinished():
        engine.step()
        metrics.on_step(0.01, engine.last_step_cost)
    # Prefill, one decode step whose tokens stay on the device, then 4 chained steps.
    assert engine.chain.num_chained_steps == 4
    assert count() - before == 4


@pytest.mark.gpu
def test_chained_launch_never_waits_for_the_device(loaded, monkeypatch) -> None:
    """Launching the next step (staging, the replay, sampling with temperature, top-k/top-p,
    min-p and seeds, a subset of rows) issues no call that waits for the GPU: CUDA's sync
    debug mode turns any such call into an error while it runs."""
    engine = make_engine(loaded, True)
    launch = engine.chain.launch

    def strict(prev, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(prev, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine.chain, "launch", strict)
    p = prompts()
    requests = {
        "greedy": (p[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        "short": (p[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
        "top": (
            p[2],
            SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
        ),
        "seeded": (p[3], SamplingParams(max_tokens=12, min_p=0.05, seed=3, ignore_eos=True)),
    }
    tokens, reasons = run(engine, requests)
    assert [len(tokens[r]) for r in requests] == [12, 4, 12, 12]
    assert set(reasons.values()) == {"length"}
    assert engine.chain.num_chained_steps >= 9
    assert engine.num_free_blocks == NUM_BLOCKS


@pytest.mark.gpu
def test_reading_tokens_back_waits_for_their_step_only(loaded, monkeypatch) -> None:
    """`step` hands out the tokens of the step before the one it launched and returns while
    that one still runs: with ~50 ms of GPU work queued behind every chained step, each call
    that launched one returns with the device still busy."""
    engine = make_engine(loaded, True)
    launch = engine.runner.execute_chained

    def slow(*args):
        out = launch(*args)
        torch.cuda._sleep(100_000_000)  # GPU clock cycles: tens of milliseconds
        return out

    monkeypatch.setattr(engine.runner, "execute_chained", slow)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompts()[0], params)
    busy_after_launch = []
    tokens = []
    while engine.has_unfinished():
        chained = engine.chain.num_chained_steps
        outs = engine.step()
        if engine.chain.num_chained_steps > chained:
            busy_after_launch.append(not torch.cuda.current_stream().query())
        tokens += [t for o in outs for t in o.new_token_ids]
    torch.cuda.synchronize()
    assert len(tokens) == 8
    assert len(busy_after_launch) == 6 and all(busy_after_launch)
