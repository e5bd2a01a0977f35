"""Sampler, what gets sampled: greedy, seeded reproducibility, and distributions (temperature,
top-k, top-p, min-p, penalties).

The distribution tests draw many tokens from one fixed logits vector and compare the counts
with the distribution computed here, in float64, straight from the definitions, by a
chi-square test at significance 1e-6 (and tokens that the definition excludes must never
appear). The global RNG is seeded, so every run sees the same draws. What happens to the
logits themselves (penalties, min_tokens, logprobs) is tested in test_sampler_logits.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sampler_rows import random_logits, row, seeded

from llmfleet.engine.sampler import Sampler, SamplingRow

# V = 16, values spread over several nats and permuted so vocabulary order != likelihood order.
BASE_LOGITS = [3.0, 2.6, 2.2, 1.9, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.8, -1.1, -1.5, -2.0, -3.0]
PERMUTATION = [5, 12, 0, 9, 3, 15, 7, 1, 10, 14, 4, 8, 13, 2, 11, 6]
FIXED_LOGITS = [BASE_LOGITS[i] for i in PERMUTATION]


# ---------------------------------------------------------------------------------------------
# The reference distribution, from the definitions.


def expected_distribution(
    logits: list[float],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(len(p), dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        assert len(set(p.tolist())) == len(p), "top_k reference assumes distinct probabilities"
        ranks = np.argsort(np.argsort(-p))  # 0 = most likely
        keep &= ranks < top_k
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        order = np.argsort(-q)
        cumulative = np.cumsum(q[order])
        # The reference is only sound away from the boundaries of the cumulative sums.
        assert np.min(np.abs(cumulative - top_p)) > 1e-3, "top_p too close to a boundary"
        size = int(np.argmax(cumulative >= top_p)) + 1  # smallest prefix reaching top_p
        kept = np.zeros(len(q), dtype=bool)
        kept[order[:size]] = True
        q = np.where(kept, q, 0.0)
        q /= q.sum()
    return q


def chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper quantile of chi-square(df) for the normal quantile z (4.753: p = 1e-6).

    Wilson-Hilferty: (X / df) ** (1/3) is close to normal with mean 1 - 2 / (9 df) and
    variance 2 / (9 df).
    """
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    total = counts.sum()
    support = expected > 0
    outside = counts[~support]
    assert outside.sum() == 0, f"excluded tokens sampled: {np.nonzero(counts * ~support)[0]}"
    if support.sum() == 1:
        return
    e = expected[support] * total
    stat = float(((counts[support] - e) ** 2 / e).sum())
    critical = chi_square_critical(int(support.sum()) - 1)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}\n{counts}\n{e}"


def sample_counts(
    num_samples: int, vocab_logits: list[float], generator: torch.Generator | None = None, **p
) -> np.ndarray:
    torch.manual_seed(1234)
    logits = torch.tensor(vocab_logits).repeat(num_samples, 1)
    rows = [row(generator=generator, **p)] * num_samples
    out = Sampler()(logits, rows)
    return np.bincount(np.asarray(out.token_ids), minlength=len(vocab_logits))


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_is_argmax() -> None:
    logits = random_logits(7, 100)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(7)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 7


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = random_logits(6, 100)
    rows = [
        row(temperature=0.0),
        row(temperature=1.0),
        row(temperature=0.0, logprobs=2),
        row(temperature=0.8, top_p=0.5, generator=seeded(3)),
        row(temperature=0.0),
        row(temperature=1.2, top_k=5),
    ]
    out = Sampler()(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = random_logits(5, 200)
    rows = [row(temperature=1.9, top_k=1) for _ in range(5)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


# ---------------------------------------------------------------------------------------------
# Seeded reproducibility


def draw_sequence(seed: int, others: list[SamplingRow], position: int, steps: int = 8) -> list:
    """Tokens a seeded row gets over `steps` steps, placed at `position` among `others`."""
    generator = seeded(seed)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        target = row(generator=generator, temperature=1.0, top_p=0.95)
        rows = others[:position] + [target] + others[position:]
        logits = random_logits(len(rows), 64, seed=100 + step)
        # The target row's logits are the same whatever the batch.
        logits[position] = random_logits(1, 64, seed=500 + step)[0]
        tokens.append(sampler(logits, rows).token_ids[position])
    return tokens


def test_same_seed_same_tokens_across_calls_and_batches() -> None:
    alone = draw_sequence(7, [], 0)
    assert draw_sequence(7, [], 0) == alone
    torch.manual_seed(99)  # the global RNG does not matter to a seeded row
    others = [
        row(temperature=0.0),
        row(temperature=1.5),
        row(generator=seeded(7), temperature=0.7, top_k=3),
        row(generator=seeded(8), temperature=1.0, min_p=0.1, presence_penalty=1.0, output=[1]),
        row(temperature=1.0, logprobs=3),
    ]
    assert draw_sequence(7, others, 0) == alone
    assert draw_sequence(7, others, 3) == alone
    assert draw_sequence(7, others, 5) == alone


def test_different_seeds_give_different_tokens() -> None:
    sequences = {tuple(draw_sequence(seed, [], 0, steps=12)) for seed in range(5)}
    assert len(sequences) == 5


def test_greedy_step_leaves_the_generator_untouched() -> None:
    generator = seeded(11)
    state = generator.get_state()
    Sampler()(random_logits(2, 32), [row(generator=generator, temperature=0.0), row()])
    assert torch.equal(generator.get_state(), state)


# ---------------------------------------------------------------------------------------------
# Distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_distribution(temperature: float) -> None:
    counts = sample_counts(40_000, FIXED_LOGITS, temperature=temperature)
    assert_matches(counts, expected_distribution(FIXED_LOGITS, temperature=temperature))


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_k": 3},
        {"top_k": 7, "temperature": 1.7},
        {"top_k": -1},
        {"top_k": 16},
        {"top_k": 100},
        {"top_p": 0.01},
        {"top_p": 0.5},
        {"top_p": 0.8, "temperature": 0.5},
        {"top_p": 0.95},
        {"min_p": 0.05},
        {"min_p": 0.3, "temperature": 1.7},
        {"min_p": 0.9},
        {"temperature": 0.7, "top_k": 8, "top_p": 0.8},
        {"temperature": 1.3, "min_p": 0.1, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.6, "min_p": 0.15},
        {"temperature": 1.5, "top_k": 10, "min_p": 0.12},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_filtered_distribution(params: dict) -> None:
    counts = sample_counts(40_000, FIXED_LOGITS, **params)
    assert_matches(counts, expected_distribution(FIXED_LOGITS, **params))


def test_top_p_renormalizes_after_top_k() -> None:
    # The top 4 of BASE_LOGITS hold 0.746 of the mass, so top_p = 0.75 over the full
    # distribution keeps 5 tokens; the top 3 hold 0.792 of the top-5 mass, so after top_k = 5
    # it keeps 3.
    assert (expected_distribution(BASE_LOGITS, top_p=0.75) > 0).sum() == 5
    params = {"top_k": 5, "top_p": 0.75}
    expected = expected_distribution(BASE_LOGITS, **params)
    assert (expected > 0).sum() == 3
    assert_matches(sample_counts(40_000, BASE_LOGITS, **params), expected)


def test_seeded_rows_sample_the_same_distribution() -> None:
    params = {"temperature": 1.3, "top_k": 9, "top_p": 0.9}
    counts = sample_counts(20_000, FIXED_LOGITS, generator=seeded(5), **params)
    assert_matches(counts, expected_distribution(FIXED_LOGITS, **params))


def test_rows_with_different_filters_share_a_batch() -> None:
    # Each row's filters are its own, whatever the other rows in the batch ask for.
    kinds = [
        {"top_k": 3},
        {"top_p": 0.5, "temperature": 1.4},
        {"min_p": 0.2},
        {"temperature": 0.8},
        {"top_k": 9, "top_p": 0.9, "temperature": 1.2},
    ]
    num_samples = 20_000
    torch.manual_seed(4321)
    logits = torch.tensor(FIXED_LOGITS).repeat(num_samples * len(kinds), 1)
    rows = [row(**p) for p in kinds] * num_samples
    tokens = np.asarray(Sampler()(logits, rows).token_ids).reshape(num_samples, len(kinds))
    for j, params in enumerate(kinds):
        counts = np.bincount(tokens[:, j], minlength=len(FIXED_LOGITS))
        assert_matches(counts, expected_distribution(FIXED_LOGITS, **params))


@pytest.mark.parametrize(
    ("params", "allowed_size"),
    [({"top_k": 20}, 20), ({"top_p": 0.3}, None), ({"min_p": 0.2}, None)],
)
def test_filtered_tokens_never_appear_in_a_large_vocabulary(params: dict, allowed_size) -> None:
    vocab = 1000
    logits = random_logits(1, vocab, seed=3)[0]
    probs = torch.softmax(logits.double() / 1.5, dim=-1)
    order = probs.argsort(descending=True)
    if "top_k" in params:
        allowed = set(order[:allowed_size].tolist())
    elif "top_p" in params:
        cumulative = probs[order].cumsum(0)
        size = int((cumulative < params["top_p"]).sum()) + 1
        allowed = set(order[:size].tolist())
    else:
        allowed = set(torch.nonzero(probs >= params["min_p"] * probs.max()).flatten().tolist())
    torch.manual_seed(0)
    out = Sampler()(logits.repeat(5000, 1), [row(temperature=1.5, **params)] * 5000)
    assert set(out.token_ids) <= allowed
    assert len(set(out.token_ids)) > 1


def test_penalties_change_the_sampled_distribution() -> None:
    logits = [2.0, 1.0, 0.5, 0.0]
    # Token 0 is in the output 3 times, token 1 in the prompt. Repetition comes first: token 0
    # (positive) is divided by 1.5, then loses presence 0.5 and frequency 3 * 0.4.
    penalized = [2.0 / 1.5 - 0.5 - 3 * 0.4, 1.0 / 1.5, 0.5, 0.0]
    params = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.5}
    num_samples = 40_000
    torch.manual_seed(7)
    rows = [row(prompt=[1], output=[0, 0, 0], **params)] * num_samples
    out = Sampler()(torch.tensor(logits).repeat(num_samples, 1), rows)
    counts = np.bincount(out.token_ids, minlength=4)
    assert_matches(counts, expected_distribution(penalized))
