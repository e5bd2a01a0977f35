"""The whole engine on a GPU (Triton attention) gives the CPU engine's greedy tokens.

Run on the GPU machine: `pytest -m gpu tests/engine/test_gpu_engine.py`.
"""

from __future__ import annotations

import pytest
import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.kv_handoff import stage_payload
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
STEPS = 32


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    from tiny_models import greedy_tokens

    return greedy_tokens(engine, prompts, STEPS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_gpu_greedy_equals_cpu(arch, make_checkpoint, tmp_path):
    path = str(make_checkpoint(arch, tmp_path))
    cfg = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(7)
    cpu_loaded = load_model(path, dtype=torch.float32, device="cpu", progress=False)
    vocab = cpu_loaded.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 23, 61)]
    ref = greedy(LLMEngine(EngineConfig(**cfg), cpu_loaded), prompts)
    gpu_loaded = load_model(path, dtype=torch.float32, device="cuda", progress=False)
    assert gpu_loaded.model.backend.name == "triton"
    engine = LLMEngine(EngineConfig(device="cuda", **cfg), gpu_loaded)
    got = greedy(engine, prompts)
    assert got == ref
    assert engine.num_free_blocks == 64


def test_gpu_seeded_sampling_reproduces(make_checkpoint, tmp_path):
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), device="cuda", progress=False)
    params = SamplingParams(n=2, max_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=32), loaded)
        engine.add_request("s", list(range(3, 20)), params)
        outs: dict[int, list[int]] = {0: [], 1: []}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.index].extend(o.new_token_ids)
        runs.append(outs)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_gpu_exported_blocks_are_read_beside_later_steps(make_checkpoint, tmp_path):
    """An export's copy runs on a side stream while the engine keeps stepping; its payload is
    the cache's content, held blocks survive until end_export, and importing the payload on a
    second engine gives the first engine's tokens."""
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), device="cuda", progress=False)
    engine = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, block_size=16), loaded)
    idle = engine.num_free_blocks
    prompt = list(range(3, 3 + 70))
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    hashes = engine.kv.cached_block_hashes()
    ids = engine.block_manager.cached_block_ids(hashes)
    read = engine.kv.start_export("put", hashes)
    engine.add_request("b", list(range(100, 140)), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():  # later steps run while the copy is in flight
        engine.step()
    payload = read.wait()
    assert payload.is_pinned() and payload.shape[0] == len(hashes)
    assert torch.equal(payload.cuda(), engine.runner.cache_blocks(ids).contiguous())
    engine.kv.end_export("put")
    assert engine.num_free_blocks == idle
    other = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=64, block_size=16), loaded)
    assert other.kv.import_cached_blocks(hashes, payload) == len(hashes)
    other.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    again = []
    while other.has_unfinished():
        again += [t for o in other.step() for t in o.new_token_ids]
    assert again == tokens


def test_gpu_staged_pushed_blocks_write_asynchronously_and_decode_the_same(
    make_checkpoint, tmp_path
):
    """A decode worker's path for pushed KV: the blocks (host views, as ZMQ frames give them)
    are staged into pinned memory off the engine thread, and written into a reservation with
    an asynchronous copy; decoding from them gives the tokens of a plain run."""
    loaded = load_model(str(make_checkpoint("llama", tmp_path)), device="cuda", progress=False)
    config = EngineConfig(device="cuda", num_kv_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    prompt = list(range(5, 5 + 50))
    plain = LLMEngine(config, loaded)
    plain.add_request("r", prompt, params)
    expected = []
    while plain.has_unfinished():
        expected += [t for o in plain.step() for t in o.new_token_ids]

    p = LLMEngine(config, loaded)
    p.add_request("r", prompt, params, prefill_only=True)
    first = p.step()[0].new_token_ids[0]
    host = p.kv.read_blocks(p.kv.pinned_block_ids("r"))
    views = [b.clone() for b in host]  # pageable host blocks, one per frame
    payload = stage_payload(views, pinned=True)
    assert payload.is_pinned() and torch.equal(payload, host)
    d = LLMEngine(config, loaded)
    assert d.kv.reserve("lease", len(prompt)) == len(views)
    d.kv.write_reserved("lease", 0, payload)
    d.start_decode("lease", "r", prompt, first, params)
    rest = []
    while d.has_unfinished():
        rest += [t for o in d.step() for t in o.new_token_ids]
    assert [first, *rest] == expected
