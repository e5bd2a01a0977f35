"""Draft-model speculation: a second model of the target's vocabulary drafts greedily over its
own paged KV cache. Its drafts are the draft model's greedy continuation after every verified
step (catch-up, rollback of rejected drafts, chunked catch-up); the engine's greedy output with
it equals the output without speculation across batch sizes and target architectures, on the
bundled model, with preemption forced and n=2; the target as its own draft has every draft
accepted; a layer-truncated draft runs the first layers only; sampled drafts expose their
distribution q; a draft of another vocabulary is refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_hf_model, prefill_logits

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import Request
from llmfleet.engine.spec_decode import make_proposer
from llmfleet.engine.spec_decode.draft_model import DraftModelProposer, TruncatedDecoder
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
GREEDY_ROW = SamplingParams(temperature=0.0)  # a request drafted for greedily
BS = 4


@pytest.fixture(scope="module")
def paths(make_checkpoint_module):
    return {
        "llama": str(make_checkpoint_module("llama")),
        "qwen2": str(make_checkpoint_module("qwen2")),
        "other_vocab": str(make_checkpoint_module("llama", vocab_size=300)),
    }


@pytest.fixture(scope="module")
def target(paths):
    return load_model(paths["llama"], dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def draft(paths):
    return load_model(paths["qwen2"], dtype=torch.float32, progress=False)


def engine_config(path: str, spec: SpeculativeConfig | None = None, **kw) -> EngineConfig:
    cfg = dict(block_size=BS, num_kv_blocks=256, max_num_batched_tokens=64)
    cfg.update(kw)
    return EngineConfig(model=path, speculative=spec, **cfg)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(5 + 3 * i),), generator=g).tolist() for i in range(n)]


def drain(engine: LLMEngine, ps, params=GREEDY):
    tokens: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return tokens


def greedy(loaded, ids: list[int], k: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(k):
        out.append(int(prefill_logits(loaded, ids, device="cpu")[-1].argmax()))
        ids.append(out[-1])
    return out


def test_drafts_are_the_draft_models_greedy_continuation_after_each_verified_step(
    paths, target, draft
):
    config = engine_config(paths["llama"], max_num_batched_tokens=16)  # catch-up in chunks
    prop = make_proposer(SpeculativeConfig("draft", model=paths["qwen2"]), target, config)
    assert isinstance(prop, DraftModelProposer)
    reqs = [Request(f"r{i}", p, GREEDY_ROW, frozenset(), BS) for i, p in enumerate(prompts(3))]
    k = 4
    got = prop.propose(reqs, k)
    assert got == [greedy(draft, r.all_token_ids, k) for r in reqs]
    # Verified: r0 kept 2 drafts and a different bonus token, r1 all 4 and a bonus, r2 none.
    for req, d, a in zip(reqs, got, [2, 4, 0], strict=True):
        for t in d[:a]:
            req.append_output(t, None)
        req.append_output((d[a] + 1) % 256 if a < k else 9, None)
    assert prop.propose(reqs, k) == [greedy(draft, r.all_token_ids, k) for r in reqs]
    # Unverified (the engine skipped the drafts): asked again, the same drafts.
    again = [greedy(draft, r.all_token_ids, k) for r in reqs]
    assert prop.propose(reqs, k) == again
    for r in reqs:
        prop.release(r.request_id)
    assert prop.bm.num_free_blocks == prop.bm.num_blocks


def test_a_draft_short_of_kv_blocks_drafts_nothing_for_what_does_not_fit(paths, target):
    config = engine_config(paths["llama"], num_kv_blocks=4)  # the draft's cache: 4 blocks too
    prop = make_proposer(SpeculativeConfig("draft", model=paths["qwen2"]), target, config)
    reqs = [Request(f"r{i}", p, GREEDY_ROW, frozenset(), BS) for i, p in enumerate(prompts(3))]
    got = prop.propose(reqs, 3)  # 7, 10 and 13 tokens + drafts: only the first fits 4 blocks
    assert [len(d) for d in got] == [3, 0, 0]


@pytest.mark.parametrize(("batch", "k"), [(1, 3), (4, 2), (6, 5)])
def test_greedy_output_equals_no_speculation_with_a_separate_draft(paths, target, batch, k):
    ps = prompts(batch, seed=batch)
    ref = drain(LLMEngine(engine_config(paths["llama"]), target), ps)
    spec = SpeculativeConfig("draft", model=paths["qwen2"], num_speculative_tokens=k)
    engine = LLMEngine(engine_config(paths["llama"], spec), target)
    assert drain(engine, ps) == ref
    stats = engine.spec_stats
    assert stats.num_drafted > 0 and stats.num_steps > 0
    prop = engine.speculator.proposer
    assert prop.bm.num_free_blocks == prop.bm.num_blocks  # every request released its blocks
    assert engine.num_free_blocks == 256


def test_greedy_output_equals_no_speculation_under_preemption_and_n2(paths, target):
    ps = prompts(3, seed=7)
    params = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    ref_engine = LLMEngine(engine_config(paths["llama"], num_kv_blocks=12), target)
    ref = drain(ref_engine, ps, params)
    spec = SpeculativeConfig("draft", model=paths["qwen2"], num_speculative_tokens=3)
    engine = LLMEngine(engine_config(paths["llama"], spec, num_kv_blocks=12), target)
    assert drain(engine, ps, params) == ref
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.spec_stats.num_drafted > 0
    assert engine.num_free_blocks == 12


def test_the_target_as_its_own_draft_accepts_every_draft(paths, target):
    ps = prompts(3, seed=3)
    ref = drain(LLMEngine(engine_config(paths["llama"]), target), ps)
    spec = SpeculativeConfig("draft", model=paths["llama"], num_speculative_tokens=4)
    engine = LLMEngine(engine_config(paths["llama"], spec), target)
    assert engine.speculator.proposer.runner.model is target.model  # weights shared
    assert drain(engine, ps) == ref
    stats = engine.spec_stats
    assert stats.num_drafted > 20
    assert stats.num_accepted == stats.num_drafted  # acceptance 1.0
    assert stats.accepted_by_position[3] > 0


def test_a_layer_truncated_draft_runs_the_first_layers_of_the_target(paths, target):
    spec = SpeculativeConfig("draft", model=paths["llama"], draft_layers=1)
    config = engine_config(paths["llama"])
    prop = make_proposer(spec, target, config)
    model = prop.runner.model
    assert isinstance(model, TruncatedDecoder) and model.inner is target.model
    assert len(prop.runner.kv_caches) == 1
    hf = build_hf_model("llama")
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    [p] = prompts(1, seed=5)
    want, ids = [], list(p)
    with torch.no_grad():
        for _ in range(3):
            want.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            ids.append(want[-1])
    req = Request("r", p, GREEDY_ROW, frozenset(), BS)
    assert prop.propose([req], 3) == [want]
    ps = prompts(3, seed=9)
    ref = drain(LLMEngine(config, target), ps)
    engine = LLMEngine(engine_config(paths["llama"], spec), target)
    assert drain(engine, ps) == ref


def test_drafts_of_another_vocabulary_or_too_many_layers_are_refused(paths, target):
    config = engine_config(paths["llama"])
    with pytest.raises(ValidationError) as err:
        make_proposer(SpeculativeConfig("draft", model=paths["other_vocab"]), target, config)
    assert err.value.field == "speculative.model"
    with pytest.raises(ValidationError) as err:
        spec = SpeculativeConfig("draft", model=paths["llama"], draft_layers=3)
        make_proposer(spec, target, config)
    assert err.value.field == "speculative.draft_layers"
    with pytest.raises(ValidationError) as err:
        SpeculativeConfig("ngram", draft_layers=1)
    assert err.value.field == "speculative.draft_layers"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_greedy_output_equals_no_speculation_on_every_architecture(
    make_checkpoint_module, paths, arch
):
    path = str(make_checkpoint_module(arch))
    loaded = load_model(path, dtype=torch.float32, progress=False)
    ps = prompts(3, seed=11)
    ref = drain(LLMEngine(engine_config(path), loaded), ps)
    # The tiny llama drafts for each target (one vocabulary, other weights and architecture).
    spec = SpeculativeConfig("draft", model=paths["llama"], num_speculative_tokens=3)
    engine = LLMEngine(engine_config(path, spec), loaded)
    assert drain(engine, ps) == ref
    assert engine.spec_stats.num_drafted > 0


@pytest.mark.slow
def test_bundled_model_as_its_own_draft_is_greedy_exact():
    from llmfleet.models.checkpoint_files import resolve_model_path

    bundled = load_model(None, dtype=torch.float32, progress=False)
    path = str(resolve_model_path(None))
    ps = [bundled.tokenizer.encode("Repeat after me: the quick brown fox jumps over the lazy dog.")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = drain(
        LLMEngine(engine_config(path, block_size=16, num_kv_blocks=64), bundled), ps, params
    )
    spec = SpeculativeConfig("draft", model=path, num_speculative_tokens=3)
    engine = LLMEngine(engine_config(path, spec, block_size=16, num_kv_blocks=64), bundled)
    assert engine.speculator.proposer.runner.model is bundled.model  # the GGUF's weights, once
    assert drain(engine, ps, params) == ref
    stats = engine.spec_stats
    assert stats.num_drafted > 0 and stats.num_accepted >= 0.9 * stats.num_drafted


@pytest.mark.gpu
@pytest.mark.parametrize("draft_layers", [None, 1])
def test_gpu_self_draft_with_cuda_graphs_is_greedy_exact(make_checkpoint, tmp_path, draft_layers):
    path = str(make_checkpoint("llama", tmp_path))
    loaded = load_model(path, dtype=torch.float32, device="cuda", progress=False)
    ps = prompts(4, seed=2)
    cfg = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, device="cuda")
    ref = drain(LLMEngine(EngineConfig(model=path, **cfg), loaded), ps)
    spec = SpeculativeConfig("draft", model=path, draft_layers=draft_layers)
    engine = LLMEngine(EngineConfig(model=path, speculative=spec, **cfg), loaded)
    prop = engine.speculator.proposer
    assert prop.runner.decode_graphs is not None  # the draft's decode steps replay graphs
    assert drain(engine, ps) == ref
    stats = engine.spec_stats
    assert stats.num_drafted > 0
    if draft_layers is None:
        assert stats.num_accepted >= 0.98 * stats.num_drafted
    assert prop.runner.decode_graphs.num_replays > 0


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_drafts_expose_their_distribution(paths, target, top_p):
    """A sampled request's drafts are drawn from the draft's processed distribution q, and q
    reaches rejection sampling: the target as its own draft then keeps (almost) every draft,
    where one-hot greedy drafts would keep only as often as the argmax gets drawn."""
    spec = SpeculativeConfig("draft", model=paths["llama"], num_speculative_tokens=3)
    engine = LLMEngine(engine_config(paths["llama"], spec), target)
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=top_p, seed=3, ignore_eos=True)
    first = drain(engine, prompts(3, seed=4), params)
    stats = engine.spec_stats
    assert stats.num_drafted > 40
    assert stats.num_accepted >= 0.97 * stats.num_drafted
    # Seeded: the same tokens again (the drafts' draws come from the request's generator).
    again = LLMEngine(engine_config(paths["llama"], spec), target)
    assert drain(again, prompts(3, seed=4), params) == first


def test_sampled_drafts_carry_their_rows_of_q(paths, target):
    config = engine_config(paths["llama"])
    prop = make_proposer(SpeculativeConfig("draft", model=paths["qwen2"]), target, config)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)]
    reqs = [Request(f"r{i}", p, params[i], frozenset(), BS) for i, p in enumerate(prompts(2))]
    drafts = prop.propose(reqs, 3)
    q_sampled, q_greedy = prop.last_draft_probs
    assert q_greedy is None
    assert q_sampled.shape == (3, 260)
    torch.testing.assert_close(q_sampled.sum(-1), torch.ones(3))
    assert ((q_sampled > 0).sum(-1) <= 5).all()  # top_k applied
    assert all(q_sampled[j, t] > 0 for j, t in enumerate(drafts[0]))  # drawn from q
