"""Embeddings through the engine equal transformers' pooled hidden states.

Tiny random-weight checkpoints (qwen2 declaring Matryoshka dimensions, llama without) run
embeddings through the whole engine (also at TP=2, and on CUDA beside graph-replayed decoding):
batched with each other and with a generating request, prompts chunked by a small token
budget, and compared with the base model's `last_hidden_state` (after the final norm) pooled
and normalized the same way. The bundled model: test_pooling_smollm2.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.forward_pass import load_for
from llmfleet.engine.pooling import PoolingOutput
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.pooling_params import PoolingParams
from llmfleet.shared.core.sampling_params import SamplingParams

LENS = (1, 7, 23, 40)
MATRYOSHKA = [16, 32]


def engine_for(path: str | None, **overrides) -> LLMEngine:
    config = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=64, dtype="float32")
    config = EngineConfig(model=path, **{**config, **overrides})
    return LLMEngine(config, load_for(config))


def prompts_for(vocab: int, lens=LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def embed(engine: LLMEngine, prompts, params: PoolingParams, *, generate: bool = False):
    """Embed every prompt in one batch (beside a generating request when `generate`)."""
    done: dict[str, PoolingOutput] = {}
    for i, p in enumerate(prompts):
        engine.pooler.add(f"e{i}", p, params, lambda out: done.__setitem__(out.request_id, out))
    if generate:
        engine.add_request("g", prompts[-1], SamplingParams(max_tokens=6, temperature=0.0))
    tokens = []
    while engine.pooler.num_active or engine.has_request("g"):
        tokens += [t for o in engine.step() if o.request_id == "g" for t in o.new_token_ids]
    assert len(tokens) == (6 if generate else 0)
    outs = [done[f"e{i}"] for i in range(len(prompts))]
    assert [o.num_prompt_tokens for o in outs] == [len(p) for p in prompts]
    return torch.tensor([o.embedding for o in outs])


def reference(base: torch.nn.Module, prompts, pooling: str, normalize=True, dims=None):
    rows = []
    with torch.inference_mode():
        for p in prompts:
            h = base(torch.tensor([p])).last_hidden_state[0].float()  # (T, hidden)
            v = h[-1] if pooling == "last" else h.mean(dim=0)
            v = v[:dims] if dims else v
            rows.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return torch.stack(rows)


def assert_embeddings_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=atol, rtol=1e-4)
    assert torch.nn.functional.cosine_similarity(ours, ref).min() > 0.9999


@pytest.fixture(scope="module")
def qwen2(make_checkpoint_module):
    path = make_checkpoint_module("qwen2", is_matryoshka=True, matryoshka_dimensions=MATRYOSHKA)
    return engine_for(str(path)), AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama(make_checkpoint_module):
    path = make_checkpoint_module("llama")
    return engine_for(str(path)), AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_pooled_hidden_states_equal_transformers(arch, pooling, request):
    engine, base = request.getfixturevalue(arch)
    prompts = prompts_for(engine.spec.vocab_size)
    ours = embed(engine, prompts, PoolingParams(pooling=pooling), generate=True)
    assert_embeddings_close(ours, reference(base, prompts, pooling))
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(prompts)), atol=1e-5)


def test_unnormalized_and_matryoshka_dimensions(qwen2):
    engine, base = qwen2
    prompts = prompts_for(engine.spec.vocab_size, (9, 30))
    raw = embed(engine, prompts, PoolingParams(pooling="mean", normalize=False))
    assert_embeddings_close(raw, reference(base, prompts, "mean", normalize=False))
    short = embed(engine, prompts, PoolingParams(dimensions=16))
    assert short.shape == (2, 16)
    assert_embeddings_close(short, reference(base, prompts, "last", dims=16))
    with pytest.raises(ValidationError) as err:
        engine.pooler.add("bad", prompts[0], PoolingParams(dimensions=20), print)
    assert err.value.field == "dimensions" and "16, 32" in err.value.message


def test_no_kv_outlives_an_embedding(qwen2):
    engine, _ = qwen2
    engine.block_manager.drain_events()
    embed(engine, prompts_for(engine.spec.vocab_size), PoolingParams(pooling="mean"))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
    assert bm.drain_events() == ([], [])  # nothing entered the prefix cache
    assert engine.num_running == engine.num_waiting == 0 and engine.pooler.num_active == 0


def test_invalid_inputs_name_the_field(llama):
    engine, _ = llama
    add = engine.pooler.add
    cases = [
        (lambda: add("x", [], PoolingParams(), print, field="inputs[2]"), "inputs[2]"),
        (lambda: add("x", [1] * 5000, PoolingParams(), print, field="inputs[0]"), "inputs[0]"),
        (lambda: add("x", [10**6], PoolingParams(), print, field="inputs[1]"), "inputs[1]"),
        (lambda: add("x", [5, 6], PoolingParams(dimensions=8), print), "dimensions"),
        (lambda: PoolingParams(pooling="cls"), "pooling"),
    ]
    for call, field in cases:
        with pytest.raises(ValidationError) as err:
            call()
        assert err.value.field == field
    assert "context length" in _message(cases[1][0])
    assert "matryoshka" in _message(cases[3][0])
    assert engine.pooler.num_active == 0 and not engine.has_unfinished()


def test_abort_frees_the_blocks(llama):
    engine, _ = llama
    got = []
    engine.pooler.add(
        "a", prompts_for(engine.spec.vocab_size, (40,))[0], PoolingParams(), got.append
    )
    engine.step()  # the first chunk runs, blocks held
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.pooler.abort("a") and not engine.pooler.abort("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    while engine.has_unfinished():
        engine.step()
    assert got == []


def test_a_preempted_embedding_is_recomputed_from_scratch(make_checkpoint_module, llama):
    """A cache of 10 blocks of 4: the embedding's second chunk finds no block while a request
    generates, so it is preempted (its first chunk's mean dropped) and runs again later."""
    _, base = llama
    engine = engine_for(str(make_checkpoint_module("llama")), num_kv_blocks=10)
    [gen, emb] = prompts_for(engine.spec.vocab_size, (12, 30))
    engine.add_request("g", gen, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    got = []
    engine.pooler.add("e", emb, PoolingParams(pooling="mean"), got.append)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions_total >= 1
    assert_embeddings_close(torch.tensor([got[0].embedding]), reference(base, [emb], "mean"))


def test_tensor_parallel_embeddings_equal_transformers(make_checkpoint_module, llama):
    _, base = llama
    path = str(make_checkpoint_module("llama"))
    config = EngineConfig(
        model=path, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=24,
        num_kv_blocks=64, dtype="float32", num_threads=1,
    )  # fmt: skip
    engine = LLMEngine(config, load_for(config))
    try:
        prompts = prompts_for(engine.spec.vocab_size)
        for pooling in ("last", "mean"):
            ours = embed(engine, prompts, PoolingParams(pooling=pooling), generate=True)
            assert_embeddings_close(ours, reference(base, prompts, pooling))
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_cuda_embeddings_beside_graph_decoding(make_checkpoint_module, llama, pooling):
    """On CUDA, with decode graphs captured: one-token embeddings beside decoding sequences
    (steps that would replay a graph) still pool the right hidden states."""
    _, base = llama
    engine = engine_for(str(make_checkpoint_module("llama")), device="cuda", max_num_seqs=8)
    assert engine.runner.decode_graphs is not None
    prompts = prompts_for(engine.spec.vocab_size, (1, 1, 12, 30))
    engine.add_request("warm", prompts[3], SamplingParams(max_tokens=40, temperature=0.0))
    while engine.num_waiting or not engine.num_running:
        engine.step()  # the generating request is decoding now
    ours = embed(engine, prompts, PoolingParams(pooling=pooling))
    # float32 on the GPU (its GEMMs and attention kernels) against the CPU reference
    assert_embeddings_close(ours, reference(base, prompts, pooling), atol=5e-4)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _message(call) -> str:
    with pytest.raises(ValidationError) as err:
        call()
    return err.value.message
