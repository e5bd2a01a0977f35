"""Speculative decoding's plain-Python parts and their accounting: prompt lookup, the
configuration, draft tokens in the scheduler's budget and KV, the rollback of rejected slots
(never cached), and the bundled model with repeat-the-text prompts."""

from __future__ import annotations

import random

import pytest
import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.cuda_graphs import DecodeBuffers
from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import Request
from llmfleet.engine.scheduler import Scheduler
from llmfleet.engine.spec_decode.ngram import NgramProposer
from llmfleet.engine.spec_decode.proposer import Computed
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

# ---- prompt lookup --------------------------------------------------------------------------


def longest_match(tokens: list[int], length: int, n_min: int, n_max: int) -> tuple[int, int]:
    """(e, n): the longest suffix n-gram of tokens[:length] (n_max down to n_min) found ending
    at an earlier e, its latest occurrence; (-1, 0) when none."""
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n : length]
        for e in range(length - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return e, n
    return -1, 0


def brute_force_lookup(
    tokens: list[int], k: int, n_min: int, n_max: int, resume: bool = False
) -> list[int]:
    """The tokens after the longest suffix match; with `resume`, when that is shorter than 2,
    after a longer (>= 2) match of the context before the last token."""
    e, n = longest_match(tokens, len(tokens), n_min, n_max)
    if resume and n < 2 and n_max >= 2:
        e2, n2 = longest_match(tokens, len(tokens) - 1, max(n_min, 2), n_max)
        if n2 > n:
            return tokens[e2 : e2 + k]
    return tokens[e : e + k] if n else []


def test_ngram_examples():
    p = NgramProposer(1, 3, resume=False)
    assert p.lookup("a", [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # "1 2" matched, then 3 9 1
    assert p.lookup("b", [5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the latest occurrence wins
    # The longest match wins over a later shorter one: "4 5 6" occurred at the start.
    assert p.lookup("c", [4, 5, 6, 1, 9, 6, 2, 4, 5, 6], 2) == [1, 9]
    assert p.lookup("d", [1, 2, 3], 3) == []  # nothing repeats
    assert p.lookup("e", [7, 7], 4) == [7]  # the continuation may run into the suffix itself
    assert NgramProposer(2, 3, resume=False).lookup("f", [1, 2, 1], 2) == []  # no 2-gram
    assert p.lookup("g", [1, 2, 1], 0) == []


def test_ngram_resumes_after_a_token_the_output_inserted():
    """Copying "a b c d e f" the model wrote "a b ," : only "," matches (in the instruction),
    so plain lookup drafts what followed that comma; resuming drafts "c d e"."""
    a, b, c, d, e, f, comma, x = range(8)
    tokens = [comma, x, a, b, c, d, e, f, a, b, comma]
    assert NgramProposer(1, 4, resume=False).lookup("r", tokens, 3) == [x, a, b]
    assert NgramProposer(1, 4).lookup("r", tokens, 3) == [c, d, e]
    # A 2-token match of the suffix itself is kept: nothing was inserted.
    assert NgramProposer(1, 4).lookup("s", [a, b, c, x, x, b, c], 2) == [x, x]


def test_ngram_matches_brute_force_as_sequences_grow():
    rng = random.Random(0)
    for trial in range(60):
        n_min, n_max = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
        resume = trial % 2 == 1
        p = NgramProposer(n_min, n_max, max_candidates=10_000, resume=resume)
        tokens = [rng.randrange(4) for _ in range(3)]
        for _ in range(60):
            want = brute_force_lookup(tokens, 3, n_min, n_max, resume)
            assert p.lookup("r", tokens, 3) == want, trial
            tokens.extend(rng.randrange(4) for _ in range(rng.randint(1, 4)))
        p.release("r")
        assert p.lookup("r", tokens, 5) == brute_force_lookup(tokens, 5, n_min, n_max, resume)


def test_ngram_lookup_cost_does_not_grow_with_the_context():
    p = NgramProposer(1, 4)
    tokens = [random.Random(1).randrange(8) for _ in range(20_000)]
    p.lookup("r", tokens, 3)  # builds the index once
    index = p._index["r"]
    for _ in range(200):
        tokens.append(3)
        p.lookup("r", tokens, 3)
    assert index.indexed == len(tokens) - 1  # extended incrementally, never rebuilt
    assert p._index["r"] is index


def test_speculative_config_validation():
    SpeculativeConfig("ngram")
    with pytest.raises(ValidationError) as e:
        SpeculativeConfig("medusa")
    assert e.value.field == "speculative.method"
    for kw, name in [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_max"),
        ({"disable_batch_size": 0}, "disable_batch_size"),
        ({"model": "/x"}, "model"),
    ]:
        with pytest.raises(ValidationError) as e:
            SpeculativeConfig("ngram", **kw)
        assert e.value.field == f"speculative.{name}"
    with pytest.raises(ValidationError) as e:
        SpeculativeConfig("draft")
    assert e.value.field == "speculative.model"
    with pytest.raises(ValidationError) as e:
        EngineConfig(simulate=True, speculative=SpeculativeConfig("ngram"))
    assert e.value.field == "speculative"
    with pytest.raises(ValidationError) as e:
        SamplingParams(speculative="yes")
    assert e.value.field == "speculative"


# ---- the scheduler --------------------------------------------------------------------------


def decoding(rid: str, num_tokens: int, drafts: list[int], bm: BlockManager) -> Request:
    """A running request with its KV computed but for its last token, and drafts."""
    req = Request(rid, list(range(num_tokens)), SamplingParams(), frozenset(), bm.block_size)
    assert bm.allocate_slots(req, num_tokens)
    req.num_computed_tokens = num_tokens - 1
    req.spec_token_ids = drafts
    return req


def running(bm: BlockManager, reqs: list[Request], budget: int) -> Scheduler:
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget)
    for r in reqs:
        sched.add_running(r)
    return sched


def test_drafts_take_budget_tokens_and_are_trimmed_to_it():
    bm = BlockManager(64, 4)
    a, b = decoding("a", 8, [1, 2, 3], bm), decoding("b", 8, [4, 5, 6], bm)
    out = running(bm, [a, b], budget=6).schedule()
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        (4, [1, 2, 3]),
        (2, [4]),
    ]
    assert out.num_batched_tokens == 6
    assert len(bm.block_ids("a")) == 3  # 8 + 3 slots
    assert all(s.samples for s in out.scheduled)


def test_short_kv_drops_drafts_instead_of_preempting():
    bm = BlockManager(4, 4)
    a, b = decoding("a", 8, [1, 2], bm), decoding("b", 6, [4, 5], bm)
    # All 4 blocks are held: a's drafts would need a third block; b's fit in its second.
    out = running(bm, [a, b], budget=64).schedule()
    assert not out.preempted
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, []), (3, [4, 5])]
    assert bm.num_free_blocks == 0


def test_trim_releases_tail_blocks_and_renews_the_table():
    bm = BlockManager(8, 4)
    req = decoding("a", 6, [1, 2, 3, 4, 5], bm)
    assert bm.allocate_slots(req, 11)  # 6 tokens + 5 drafts: 3 blocks
    table = bm.block_ids("a")
    bufs = DecodeBuffers(max_batch_size=2, max_blocks_per_seq=4, block_size=4)
    bufs.fill([1], [10], [table], 1)
    bm.trim(req, 7)  # one draft kept: 7 tokens, 2 blocks
    assert len(bm.block_ids("a")) == 2 and bm.num_free_blocks == 6
    assert table is not bm.block_ids("a")  # a new list: readers caching by identity see it
    other = decoding("b", 4, [], bm)  # takes the freed block
    assert bm.allocate_slots(req, 11)
    new = bm.block_ids("a")
    assert new[2] != table[2] and bm.block_ids("b")[0] == table[2]
    bufs.fill([1], [10], [new], 1)
    assert bufs.block_tables(1)[0, :3].tolist() == new
    bm.free(req)
    bm.free(other)
    assert bm.num_free_blocks == 8


def test_rejected_slots_are_released_and_never_cached(make_checkpoint_module):
    loaded = load_model(str(make_checkpoint_module("llama")), dtype=torch.float32)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=5)
    cfg = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    phrase = torch.randint(3, 250, (5,), generator=g).tolist()
    prompts = [phrase * 3, torch.randint(3, 250, (9,), generator=g).tolist() * 2]

    def greedy(engine, prompt, rid):
        engine.add_request(rid, prompt, params)
        toks = []
        while engine.has_unfinished():
            for o in engine.step():
                toks += o.new_token_ids
        return toks

    fast = LLMEngine(EngineConfig(speculative=spec, **cfg), loaded)
    plain = LLMEngine(EngineConfig(**cfg), loaded)
    for i, p in enumerate(prompts):
        first = greedy(fast, p, f"a{i}")
        assert first == greedy(plain, p, f"a{i}")
        # The continuation of prompt + output takes prefix hits on blocks written by verified
        # steps: had one kept a rejected draft's KV, the tokens would differ.
        again = greedy(fast, p + first, f"b{i}")
        assert again == greedy(plain, p + first, f"b{i}")
        assert fast.block_manager.stats.num_hits > 0
    stats = fast.spec_stats
    assert 0 < stats.num_accepted < stats.num_drafted  # some drafts were rejected
    assert fast.num_free_blocks == 128


def test_drafts_as_decode_rows_equal_the_multi_token_verify(make_checkpoint_module):
    """The decode graphs take a sequence's drafts as extra decode rows over its block table;
    that gives the logits of one multi-token query over the paged cache (each layer writes
    every row's KV before attending)."""
    loaded = load_model(str(make_checkpoint_module("qwen3")), dtype=torch.float32)
    model, spec = loaded.model, loaded.spec
    prompt = torch.randint(3, 250, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    drafts = [7, 8, 9]
    table = [5, 2, 7, 1]  # block size 4: 16 slots, scattered blocks

    def logits(query_lens, seq_lens, tables, ids, positions):
        kv = [
            torch.zeros(2, 8, 4, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)
        ]
        with torch.no_grad():
            first = AttentionMetadata.build([9], [9], [table], 4)
            model(torch.tensor(prompt[:9]), torch.arange(9), kv, first)
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4)
            return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), kv, meta))

    ids = [prompt[9], *drafts]
    varlen = logits([4], [13], [table], ids, [9, 10, 11, 12])
    rows = logits([1] * 4, [10, 11, 12, 13], [table] * 4, ids, [9, 10, 11, 12])
    torch.testing.assert_close(rows, varlen, atol=1e-4, rtol=1e-4)


class Recorder(NgramProposer):
    """Prompt lookup that also asks for the target's hidden states and records every
    `observe` and `release`."""

    hidden_layers = (0, -1)

    def __init__(self) -> None:
        super().__init__(1, 3)
        self.seen: dict[str, list[Computed]] = {}
        self.released: list[str] = []

    def observe(self, computed):
        for c in computed:
            self.seen.setdefault(c.request.request_id, []).append(
                Computed(c.request, c.start, c.num_kept, c.hidden.clone())
            )

    def release(self, request_id):
        super().release(request_id)
        self.released.append(request_id)


def test_observe_sees_every_kept_token_with_its_hidden_states(make_checkpoint_module):
    loaded = load_model(str(make_checkpoint_module("qwen2")), dtype=torch.float32)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    # Chunks of 8 tokens per step: the 21-token prompt takes three prefill steps.
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, speculative=spec)
    engine = LLMEngine(cfg, loaded)
    recorder = Recorder()
    engine.speculator.proposer = recorder
    engine.runner.set_capture_layers(recorder.hidden_layers)
    engine.speculator.observes = True
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 250, (7,), generator=g).tolist() * 3
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    assert engine.spec_stats.num_accepted > 0
    assert recorder.released == ["r"]
    seen = recorder.seen["r"]
    assert [c.num_kept for c in seen[:3]] == [8, 8, 5]  # the prompt's chunks
    assert any(c.num_kept > 1 for c in seen[3:])  # verified steps that kept drafts
    at = 0
    for c in seen:  # contiguous: every computed token observed exactly once
        assert c.start == at and c.hidden.shape == (c.num_kept, 2 * loaded.spec.hidden_size)
        at += c.num_kept
    # The recorded rows are the target's layer 0 and last-layer residual streams at those
    # tokens: the same as one forward pass over the whole sequence.
    tokens = (prompt + out)[:at]
    model = engine.runner.model
    kv = [torch.zeros(2, 16, 4, loaded.spec.num_kv_heads, loaded.spec.head_dim) for _ in range(2)]
    meta = AttentionMetadata.build([at], [at], [list(range(16))], 4)
    with torch.no_grad():
        model(torch.tensor(tokens), torch.arange(at), kv, meta)
    want = model.aux_hidden
    got = torch.cat([c.hidden for c in seen])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bundled_model_repeats_text_with_accepted_drafts():
    loaded = load_model(None, dtype=torch.float32, progress=False)
    tok = loaded.tokenizer
    text = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step."
    )
    msgs = [f"Repeat this text exactly: {text}"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
        for m in msgs
    ]
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    params = SamplingParams(max_tokens=32, temperature=0.0)

    def run(spec):
        engine = LLMEngine(EngineConfig(num_kv_blocks=64, speculative=spec), loaded)
        out = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, engine

    ref, _ = run(None)
    got, engine = run(SpeculativeConfig("ngram", num_speculative_tokens=4))
    assert got == ref
    stats = engine.spec_stats
    assert stats.num_accepted > 0
    # Copying text: most steps keep drafts, so fewer steps than tokens.
    assert stats.num_emitted > 1.5 * stats.num_steps
