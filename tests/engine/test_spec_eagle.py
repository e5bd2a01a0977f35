"""EAGLE / EAGLE-3 speculation: the target's hidden-state capture, the heads loaded from their
published layouts against a direct torch computation of their equations, and the proposer's
incremental drafting (observe / propose over its paged cache) against the same equations
recomputed densely."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from spec_checkpoints.eagle import (
    EPS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    THETA,
    read_tensors,
    write_eagle1,
    write_eagle3,
)
from tiny_models import build_hf_model

from llmfleet.engine.request import Request
from llmfleet.engine.spec_decode import Computed, make_proposer
from llmfleet.engine.spec_decode.eagle import EagleProposer
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.attention.reference import TorchReferenceBackend
from llmfleet.models.eagle import load_eagle_head
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

BS = 4  # block size of the paged caches here
GREEDY_ROW = SamplingParams(temperature=0.0)  # a request drafted for greedily


# ---- the equations, densely, from the checkpoint's tensors ------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # (T, heads, D)
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv  # (T, D/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(x: torch.Tensor, t: dict, p: str, pos: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    q = (x @ t[f"{p}self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (x @ t[f"{p}self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    v = (x @ t[f"{p}self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    q, k = rope(q, pos), rope(k, pos)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    return o @ t[f"{p}self_attn.o_proj.weight"].T


def mlp(x: torch.Tensor, t: dict, p: str) -> torch.Tensor:
    gate, up = x @ t[f"{p}mlp.gate_proj.weight"].T, x @ t[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def eagle1_ref(t, embed, ids, feats, pos):  # features (T, H) -> next features (T, H)
    x = torch.cat([embed[ids], feats], -1) @ t["fc.weight"].T + t["fc.bias"]
    h = x + attention(x, t, "layers.0.", pos)
    return h + mlp(rms(h, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0.")


def eagle3_ref(t, embed, ids, g, pos):  # projected features g (T, H) -> prenorm out (T, H)
    p = "midlayer."
    x = torch.cat(
        [rms(embed[ids], t[p + "input_layernorm.weight"]), rms(g, t[p + "hidden_norm.weight"])], -1
    )
    h = g + attention(x, t, p, pos)
    return h + mlp(rms(h, t[p + "post_attention_layernorm.weight"]), t, p)


def eagle3_ids(t, out):  # greedy target ids from prenorm features
    d = (rms(out, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return d + t["d2t"][d]


# ---- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_path(make_checkpoint_module):
    return str(make_checkpoint_module("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle")
    return {
        1: write_eagle1(d / "eagle1"),
        3: write_eagle3(d / "eagle3"),
        "3ids": write_eagle3(d / "eagle3ids", seed=1, aux_layer_ids=[1, 2, 4]),
        "1emb": write_eagle1(d / "eagle1emb", seed=2, embeddings=True),
    }


def dense_aux(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh prefill of `ids`: (captured rows (T, width), final hidden (T, H))."""
    n = len(ids)
    nb = -(-n // BS)
    kv = [torch.zeros(2, nb, BS, KV_HEADS, HEAD_DIM) for _ in model.layers]
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], BS)
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(n), kv, meta)
    return model.aux_hidden, h


def test_capture_layers_are_the_residual_stream_after_each_layer(target, target_path):
    model = target.model
    ids = [5, 17, 99, 3, 250, 42, 7]
    model.capture_layers = (0, 2, -1)
    try:
        aux, out = dense_aux(model, ids)
        model.capture_layers = ()
        none, out2 = dense_aux(model, ids)
    finally:
        model.capture_layers = ()
    assert none is None and model.aux_hidden is None
    assert aux.shape == (len(ids), 3 * 64)
    hf = build_hf_model("llama", num_hidden_layers=4)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is transformers' residual stream after layer i.
    torch.testing.assert_close(aux[:, :64], states[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux[:, 64:128], states[3][0], atol=1e-4, rtol=1e-4)
    # After the last layer, before the final norm: the norm of it is the model's output.
    torch.testing.assert_close(model.norm(aux[:, 128:]), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out2)
    model.capture_layers = (4,)
    with pytest.raises(ValueError, match="outside"):
        dense_aux(model, ids)
    model.capture_layers = ()


@pytest.mark.parametrize("version", [1, 3])
def test_head_forward_over_the_paged_cache_equals_the_equations(version, heads, target):
    path = heads[version]
    t = read_tensors(path)
    head = load_eagle_head(
        path, dtype=torch.float32, device="cpu", backend=TorchReferenceBackend(), max_position=64
    )
    embed = target.model.embed_tokens.weight.detach()
    g = torch.Generator().manual_seed(3)
    n = 9
    ids = torch.randint(0, 260, (n,), generator=g)
    pos = torch.arange(n)
    if version == 1:
        feats = torch.randn(n, 64, generator=g)
        ref = eagle1_ref(t, embed, ids, feats, pos)
    else:
        aux = torch.randn(n, 3 * 64, generator=g)
        feats = head.project(aux)
        torch.testing.assert_close(feats, aux @ t["fc.weight"].T, atol=1e-5, rtol=1e-5)
        ref = eagle3_ref(t, embed, ids, feats, pos)
    # Paged: a 6-token chunk, then three single-token steps, blocks scattered.
    table = [7, 2, 5]
    kv = [torch.zeros(2, 8, BS, KV_HEADS, HEAD_DIM) for _ in head.layers]
    outs = []
    for start, stop in [(0, 6), (6, 7), (7, 8), (8, 9)]:
        meta = AttentionMetadata.build([stop - start], [stop], [table], BS)
        with torch.no_grad():
            outs.append(head(embed[ids[start:stop]], feats[start:stop], pos[start:stop], kv, meta))
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        got = head.draft_logits(ref, target.model.compute_logits).argmax(-1)
    want = (ref @ target.model.lm_head.weight.T).argmax(-1) if version == 1 else eagle3_ids(t, ref)
    assert got.tolist() == want.tolist()
    if version == 3:
        assert set(got.tolist()) <= set((torch.arange(200) + t["d2t"]).tolist())


def reference_drafts(version, t, model, tokens, offset, k):
    """Greedy drafts after `tokens` by the equations, recomputed densely each step, the head
    seeing positions `offset` .. on."""
    aux, _ = dense_aux(model, tokens)
    embed = t.get("embed_tokens.weight", model.embed_tokens.weight.detach())  # the head's own?
    n = len(tokens)
    with torch.no_grad():
        feats = (
            model.norm(aux[offset : n - 1])
            if version == 1
            else aux[offset : n - 1] @ t["fc.weight"].T
        )
        ids = list(tokens[offset + 1 : n])
        drafts = []
        for _ in range(k):
            pos = torch.arange(offset, offset + len(ids))
            fn = eagle1_ref if version == 1 else eagle3_ref
            out = fn(t, embed, torch.tensor(ids), feats, pos)
            last = out[-1:]
            nxt = (
                (last @ model.lm_head.weight.T).argmax(-1) if version == 1 else eagle3_ids(t, last)
            )
            drafts.append(int(nxt))
            ids.append(int(nxt))
            feats = torch.cat([feats, last])
    return drafts


@pytest.mark.parametrize("which", [1, 3, "3ids", "1emb"])
def test_proposer_drafts_equal_dense_drafting_across_verified_steps(
    which, heads, target, target_path
):
    version = 1 if which in (1, "1emb") else 3
    path = heads[which]
    t = read_tensors(path)
    config = EngineConfig(model=target_path, block_size=BS, num_kv_blocks=64)
    prop = make_proposer(SpeculativeConfig("eagle", model=str(path)), target, config)
    assert isinstance(prop, EagleProposer)
    want_layers = {1: (-1,), 3: (1, 1, 0), "3ids": (0, 1, 3), "1emb": (-1,)}[which]
    assert prop.hidden_layers == want_layers
    model = target.model
    model.capture_layers = prop.hidden_layers
    try:
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (10, 5, 13)]
        offsets = [0, 0, 4]  # the third request's first 4 positions were never computed here
        reqs = [Request(f"r{i}", p, GREEDY_ROW, frozenset(), BS) for i, p in enumerate(prompts)]
        # Prefill: the target computes each prompt (from its offset), samples a token.
        computed = []
        for req, off in zip(reqs, offsets, strict=True):
            aux, h = dense_aux(model, req.all_token_ids)
            start, n = off, req.num_tokens
            req.append_output(int(model.compute_logits(h[-1:]).argmax()), None)
            computed.append(Computed(req, start, n - start, aux[start:n]))
        prop.observe(computed)
        k = 3
        drafts = prop.propose(reqs, k)
        for req, off, got in zip(reqs, offsets, drafts, strict=True):
            assert got == reference_drafts(version, t, model, req.all_token_ids, off, k)
        # Verification: request 0 keeps its first draft and gets a different bonus token;
        # request 1 keeps all three and a bonus; request 2 keeps none.
        kept = [1, 3, 0]
        computed = []
        for req, got, a in zip(reqs, drafts, kept, strict=True):
            start = req.num_tokens - 1
            for tok in got[:a]:
                req.append_output(tok, None)
            req.append_output((got[a] + 1) % 256 if a < k else 7, None)
            aux, _ = dense_aux(model, req.all_token_ids)
            computed.append(Computed(req, start, 1 + a, aux[start : start + 1 + a]))
        prop.observe(computed)
        drafts = prop.propose(reqs, k)
        for req, off, got in zip(reqs, offsets, drafts, strict=True):
            assert got == reference_drafts(version, t, model, req.all_token_ids, off, k)
        for req in reqs:
            prop.release(req.request_id)
        assert prop.bm.num_free_blocks == prop.bm.num_blocks
        assert prop.propose(reqs, k) == [[], [], []]  # released: nothing seen, no drafts
    finally:
        model.capture_layers = ()


def test_heads_that_do_not_fit_the_target_are_refused(heads, target, target_path, tmp_path):
    config = EngineConfig(model=target_path, block_size=BS, num_kv_blocks=16)
    small = write_eagle3(tmp_path / "deep", aux_layer_ids=[1, 2, 9])
    with pytest.raises(ValidationError) as err:
        make_proposer(SpeculativeConfig("eagle", model=str(small)), target, config)
    assert err.value.field == "speculative.model"
    with pytest.raises(ValidationError) as err:
        make_proposer(SpeculativeConfig("eagle", model=str(tmp_path)), target, config)
    assert err.value.field == "speculative.model"


# ---- through the engine -----------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def drain(engine, prompts, params=GREEDY):
    tokens: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return tokens


@pytest.fixture
def engine_of(target, target_path):
    from llmfleet.engine.engine import LLMEngine

    def make(head=None, k=3, **kw):
        spec = (
            None
            if head is None
            else SpeculativeConfig("eagle", model=str(head), num_speculative_tokens=k)
        )
        cfg = dict(block_size=BS, num_kv_blocks=256, max_num_batched_tokens=32)
        cfg.update(kw)
        return LLMEngine(EngineConfig(model=target_path, speculative=spec, **cfg), target)

    yield make
    target.model.capture_layers = ()  # the module-scoped model serves later tests too


@pytest.mark.parametrize(("which", "batch", "k"), [(1, 1, 3), (1, 5, 2), (3, 4, 4), ("3ids", 2, 1)])
def test_engine_greedy_output_equals_no_speculation(which, batch, k, heads, engine_of):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 256, (int(4 + 5 * i),), generator=g).tolist() for i in range(batch)]
    ref = drain(engine_of(), prompts)
    engine = engine_of(heads[which], k=k)
    assert drain(engine, prompts) == ref
    assert engine.spec_stats.num_drafted > 0
    prop = engine.speculator.proposer
    assert prop.bm.num_free_blocks == prop.bm.num_blocks
    assert engine.num_free_blocks == 256


def test_engine_greedy_output_equals_no_speculation_under_preemption_and_n2(heads, engine_of):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(6 + 4 * i),), generator=g).tolist() for i in range(3)]
    params = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = drain(engine_of(num_kv_blocks=12), prompts, params)
    engine = engine_of(heads[3], k=3, num_kv_blocks=12)
    assert drain(engine, prompts, params) == ref
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.spec_stats.num_drafted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("which", [1, 3])
def test_gpu_engine_greedy_output_equals_no_speculation(which, heads, target_path):
    from llmfleet.engine.engine import LLMEngine

    loaded = load_model(target_path, dtype=torch.float32, device="cuda", progress=False)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (int(6 + 9 * i),), generator=g).tolist() for i in range(4)]
    cfg = dict(model=target_path, block_size=16, num_kv_blocks=64, device="cuda")
    ref = drain(LLMEngine(EngineConfig(**cfg), loaded), prompts)
    spec = SpeculativeConfig("eagle", model=str(heads[which]), num_speculative_tokens=3)
    engine = LLMEngine(EngineConfig(speculative=spec, **cfg), loaded)
    assert engine.speculator.proposer.head.backend.name == "triton"
    assert drain(engine, prompts) == ref
    assert engine.spec_stats.num_drafted > 0


def test_sampled_drafts_carry_their_rows_of_q(heads, target, target_path):
    config = EngineConfig(model=target_path, block_size=BS, num_kv_blocks=64)
    prop = make_proposer(SpeculativeConfig("eagle", model=str(heads[3])), target, config)
    t = read_tensors(heads[3])
    vocab = set((torch.arange(200) + t["d2t"]).tolist())
    model = target.model
    model.capture_layers = prop.hidden_layers
    try:
        params = [SamplingParams(temperature=0.8, top_k=6), SamplingParams(temperature=0.0)]
        g = torch.Generator().manual_seed(2)
        reqs = [
            Request(f"r{i}", torch.randint(0, 256, (9,), generator=g).tolist(), p, frozenset(), BS)
            for i, p in enumerate(params)
        ]
        computed = []
        for req in reqs:
            aux, h = dense_aux(model, req.all_token_ids)
            n = req.num_tokens
            req.append_output(int(model.compute_logits(h[-1:]).argmax()), None)
            computed.append(Computed(req, 0, n, aux))
        prop.observe(computed)
        drafts = prop.propose(reqs, 3)
    finally:
        model.capture_layers = ()
    q_sampled, q_greedy = prop.last_draft_probs
    assert q_greedy is None
    assert q_sampled.shape == (3, 260)
    torch.testing.assert_close(q_sampled.sum(-1), torch.ones(3))
    support = [set(torch.nonzero(row).flatten().tolist()) for row in q_sampled]
    assert all(len(s) <= 6 and s <= vocab for s in support)  # top_k, draft vocabulary
    assert all(t in s for t, s in zip(drafts[0], support, strict=True))  # drawn from q


def test_engine_seeded_sampling_with_eagle_reproduces(heads, engine_of):
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (int(5 + 4 * i),), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = engine_of(heads[1], k=3)
        runs.append(drain(engine, prompts, params))
        assert engine.spec_stats.num_drafted > 0
    assert runs[0] == runs[1]
