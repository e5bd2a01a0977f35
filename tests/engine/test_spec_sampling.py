"""Speculative decoding keeps the target's distribution exactly when sampling.

The rejection sampler alone: its first token follows p whatever the drafts and their
distribution q, and so does the next one once the first draft is kept. Through the engine: a
16-token-vocabulary model sampled many times (seeded) with drafts that are often wrong (random
one-hot drafts; drafts drawn from a fixed q with `last_draft_probs`) gives first tokens,
second tokens and (first, second) pairs whose counts fit the model's exact distribution
(computed from its logits) by a chi-square test at p = 0.001, as do the counts without drafts.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from tiny_models import build_hf_model, prefill_logits, save_checkpoint

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.sampler import SamplingRow
from llmfleet.engine.spec_decode.proposer import Proposer
from llmfleet.engine.spec_decode.rejection import Verify, rejection_sample
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig

VOCAB = 16
PROMPT = [1, 2, 3, 4, 5]


def chi2_critical(df: int, alpha_z: float = 3.0902) -> float:
    """The chi-square critical value at p = 0.001 (z = 3.0902), by Wilson-Hilferty (within
    about 1% for df >= 3)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + alpha_z * math.sqrt(c)) ** 3


def chi2_fits(counts: Counter, probs: dict, n: int) -> tuple[float, float]:
    """(statistic, critical value) of counts against probabilities; cells expecting fewer
    than 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    outside = n - sum(counts.get(k, 0) for k in probs)  # never expected: must not happen
    assert outside == 0
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    return stat, chi2_critical(max(cells - 1, 3))


# ---- the rejection sampler alone ------------------------------------------------------------


def _row(temperature: float, seed: int | None = None, **kw) -> SamplingRow:
    params = SamplingParams(temperature=temperature, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, gen, [1], [], frozenset())


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 5)])
def test_rejection_sampler_first_tokens_follow_p(with_q, temperature, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g) * 1.5  # rows p0, p1, p2 of a 2-draft sequence
    q = torch.softmax(torch.randn(2, 8, generator=g), dim=-1)  # the drafts' distribution
    n = 6000
    draws = torch.multinomial(q, n, replacement=True, generator=g).T.tolist()  # (n, 2)
    fixed = [5, 2]  # a one-hot proposer's drafts
    seqs = [
        Verify(
            _row(temperature, seed=i, top_k=top_k),
            draws[i] if with_q else list(fixed),
            q if with_q else None,
        )
        for i in range(n)
    ]
    out = rejection_sample(logits.repeat(n, 1), seqs)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    p0 = dict(enumerate(probs[0].tolist()))
    stat, crit = chi2_fits(Counter(o[0] for o in out), p0, n)
    assert stat < crit, (stat, crit)
    # Given the first draft was kept, the next token follows p1.
    kept = [o for o, s in zip(out, seqs, strict=True) if o[0] == s.drafts[0] and len(o) > 1]
    assert len(kept) > 500
    stat, crit = chi2_fits(
        Counter(o[1] for o in kept), dict(enumerate(probs[1].tolist())), len(kept)
    )
    assert stat < crit, (stat, crit)
    assert all(1 <= len(o) <= 3 for o in out)


def test_rejection_sampler_greedy_and_min_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    greedy = SamplingRow(SamplingParams(temperature=0.0), None, [1], [], frozenset())
    assert rejection_sample(logits, [Verify(greedy, [1, 2])]) == [[1, 2, 3]]
    assert rejection_sample(logits, [Verify(greedy, [1, 0])]) == [[1, 2]]
    assert rejection_sample(logits, [Verify(greedy, [2, 2])]) == [[1]]
    # Token 2 is a stop id held back until 2 output tokens exist: row 1 (output index 1)
    # masks it, so the target's choice there is 0.
    held = SamplingRow(
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,)),
        None,
        [1],
        [],
        frozenset({2}),
    )
    assert rejection_sample(logits, [Verify(held, [1, 2])]) == [[1, 0]]


def test_seeded_rejection_sampling_is_reproducible():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))

    def run(seed):
        return rejection_sample(logits, [Verify(_row(1.0, seed=seed), [1, 2, 3])])

    assert run(7) == run(7)
    assert len({tuple(run(s)[0]) for s in range(40)}) > 1


# ---- through the engine ---------------------------------------------------------------------


class RandomProposer(Proposer):
    """k uniformly random one-hot drafts: mostly rejected."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, reqs, k):
        return [[self.rng.randrange(VOCAB) for _ in range(k)] for _ in reqs]


class SampledProposer(Proposer):
    """k drafts drawn from a fixed distribution q, reported in `last_draft_probs`."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(2.0 * torch.randn(VOCAB, generator=g), dim=-1)
        self.g = g

    def propose(self, reqs, k):
        drafts = torch.multinomial(self.q, len(reqs) * k, replacement=True, generator=self.g)
        drafts = drafts.view(len(reqs), k).tolist()
        self.last_draft_probs = [self.q.expand(k, VOCAB) for _ in reqs]
        return drafts


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    model = build_hf_model(
        "llama", vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, num_hidden_layers=1
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked distribution: wrong drafts are rejected
    path = save_checkpoint(model, tmp_path_factory.mktemp("v16") / "llama")
    return load_model(str(path), dtype=torch.float32)


_JOINTS: dict[tuple[int, float], dict[tuple[int, int, int], float]] = {}


def exact_joint(loaded, temperature: float) -> dict[tuple[int, int, int], float]:
    """p(x, y, z) of the first three generated tokens, from the model's logits."""
    key = (id(loaded), temperature)
    if key not in _JOINTS:
        _JOINTS[key] = _exact_joint(loaded, temperature)
    return _JOINTS[key]


def _exact_joint(loaded, temperature: float) -> dict[tuple[int, int, int], float]:

    def next_probs(ids: list[int]) -> list[float]:
        return torch.softmax(prefill_logits(loaded, ids, "cpu")[-1] / temperature, -1).tolist()

    joint = {}
    for x, px in enumerate(next_probs(PROMPT)):
        for y, py in enumerate(next_probs(PROMPT + [x])):
            for z, pz in enumerate(next_probs(PROMPT + [x, y])):
                joint[(x, y, z)] = px * py * pz
    return joint


def marginal(joint: dict, positions: tuple[int, ...]) -> dict:
    out: Counter = Counter()
    for key, p in joint.items():
        out[tuple(key[i] for i in positions)] += p
    return dict(out)


def sample_many(loaded, temperature: float, n: int, proposer: Proposer | None, seed0: int):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3) if proposer else None
    cfg = EngineConfig(
        block_size=4,
        num_kv_blocks=4096,
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        speculative=spec,
    )
    engine = LLMEngine(cfg, loaded)
    if proposer is not None:
        engine.speculator.proposer = proposer
    out: dict[str, list[int]] = {}
    for i in range(n):
        params = SamplingParams(
            max_tokens=4, temperature=temperature, seed=seed0 + i, ignore_eos=True
        )
        engine.add_request(f"s{i}", PROMPT, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(len(t) == 4 for t in out.values()) and len(out) == n
    return list(out.values()), engine


@pytest.mark.parametrize(
    ("temperature", "proposer"),
    [(1.0, None), (1.0, "random"), (1.0, "sampled"), (0.7, "random"), (0.7, "sampled")],
)
def test_engine_sampling_with_drafts_matches_the_target_distribution(
    small_vocab, temperature, proposer
):
    """The first token comes from the prefill; the second and third from steps that verify
    1-3 drafts (k = 3, capped by max_tokens = 4)."""
    joint = exact_joint(small_vocab, temperature)
    n = 1000
    make = {
        None: lambda: None,
        "random": lambda: RandomProposer(1),
        "sampled": lambda: SampledProposer(2),
    }
    samples, engine = sample_many(small_vocab, temperature, n, make[proposer](), seed0=1000)
    if proposer is not None:
        stats = engine.spec_stats
        assert stats.num_drafted > n  # every sequence was drafted for
        assert 0 < stats.num_accepted < stats.num_drafted  # and rejections happened
    for positions in [(0,), (1,), (2,), (1, 2), (0, 1)]:
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        stat, crit = chi2_fits(counts, marginal(joint, positions), n)
        assert stat < crit, (positions, stat, crit)


def test_the_chi_square_test_has_power(small_vocab):
    """Accepting every random draft (no rejection) is far off the target: the test above
    would see it."""
    second = marginal(exact_joint(small_vocab, 1.0), (1,))
    rng = random.Random(0)
    wrong = Counter((rng.randrange(VOCAB),) for _ in range(1500))
    stat, crit = chi2_fits(wrong, second, 1500)
    assert stat > 5 * crit


def test_seeded_sampling_with_drafts_is_reproducible(small_vocab):
    first, _ = sample_many(small_vocab, 1.0, 60, RandomProposer(1), seed0=5)
    again, _ = sample_many(small_vocab, 1.0, 60, RandomProposer(1), seed0=5)
    other, _ = sample_many(small_vocab, 1.0, 60, RandomProposer(1), seed0=500)
    assert first == again
    assert first != other
