"""Sampler: greedy, seeded reproducibility, distributions, penalties, min_tokens, logprobs.

The distribution tests draw many tokens from one fixed logits vector and compare the counts
with the distribution computed here, in float64, straight from the definitions, by a
chi-square test at significance 1e-6 (and tokens that the definition excludes must never
appear). The global RNG is seeded, so every run sees the same draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmfleet.engine.sampler import (
    Sampler,
    SamplingRow,
    process_logits,
)
from llmfleet.shared.core.sampling_params import SamplingParams

EOS = 2

# V = 16, values spread over several nats and permuted so vocabulary order != likelihood order.
BASE_LOGITS = [3.0, 2.6, 2.2, 1.9, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.4, -0.8, -1.1, -1.5, -2.0, -3.0]
PERMUTATION = [5, 12, 0, 9, 3, 15, 7, 1, 10, 14, 4, 8, 13, 2, 11, 6]
FIXED_LOGITS = [BASE_LOGITS[i] for i in PERMUTATION]


def row(
    generator: torch.Generator | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop: frozenset[int] = frozenset({EOS}),
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        generator=generator,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        stop_token_ids=stop,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=seeded(seed)) * 3.0


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


# ---------------------------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[4.0, -1.0, 2.0, -3.0, 0.5, 0.0]])
    rows = [row(prompt=[0, 1], output=[4, 4], repetition_penalty=2.0)]
    expected = torch.tensor([[2.0, -2.0, 2.0, -3.0, 0.25, 0.0]])
    assert torch.equal(process_logits(logits, rows), expected)


def test_repetition_penalty_below_one_rewards_seen_tokens() -> None:
    logits = torch.tensor([[1.0, -2.0, 1.5]])
    rows = [row(prompt=[0], output=[1], repetition_penalty=0.5)]
    assert torch.equal(process_logits(logits, rows), torch.tensor([[2.0, -1.0, 1.5]]))


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 6)
    rows = [
        row(prompt=[1, 1, 5], output=[3, 3, 3, 5], presence_penalty=0.25, frequency_penalty=0.5)
    ]
    expected = torch.tensor([[0.0, 0.0, 0.0, -1.75, 0.0, -0.75]])
    assert torch.equal(process_logits(logits, rows), expected)


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    rows = [row(output=[1], presence_penalty=-2.0)]
    assert torch.equal(process_logits(logits, rows), torch.tensor([[1.0, 2.0]]))


def test_repetition_then_presence_penalty_order() -> None:
    logits = torch.tensor([[0.0, 4.0, 0.0, -1.0]])
    rows = [row(prompt=[1], output=[3], repetition_penalty=2.0, presence_penalty=0.5)]
    # Token 1: 4 / 2; token 3: -1 * 2 - 0.5.
    assert torch.equal(process_logits(logits, rows), torch.tensor([[0.0, 2.0, 0.0, -2.5]]))


def test_penalties_apply_per_row_in_a_batch() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]]).repeat(4, 1)
    rows = [
        row(temperature=0.0, output=[0], repetition_penalty=2.0),  # 1.5 < 2: token 1
        row(temperature=0.0, output=[0]),  # no penalty: token 0
        row(temperature=0.0, output=[0, 0, 1], frequency_penalty=1.0),  # [1, 1, 1]: token 0
        row(temperature=1.0, top_k=1, output=[0, 1], presence_penalty=1.5),  # [1.5, 0.5, 1]
    ]
    assert Sampler()(logits, rows).token_ids == [1, 0, 0, 0]
    rows[2] = row(temperature=0.0, output=[0, 0, 0, 1], frequency_penalty=1.0)  # [0, 1, 1]
    assert Sampler()(logits, rows).token_ids[2] == 1


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


# ---------------------------------------------------------------------------------------------
# min_tokens


def test_min_tokens_blocks_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 4.0]])
    stop = frozenset({EOS, 4})
    sampler = Sampler()
    for produced in range(3):
        rows = [row(temperature=0.0, min_tokens=3, output=[0] * produced, stop=stop)]
        assert sampler(logits, rows).token_ids == [3]
    rows = [row(temperature=0.0, min_tokens=3, output=[0] * 3, stop=stop)]
    assert sampler(logits, rows).token_ids == [EOS]


def test_min_tokens_holds_when_sampling() -> None:
    logits = torch.tensor([[0.0, 0.0, 6.0, 0.0]]).repeat(3000, 1)
    torch.manual_seed(0)
    blocked = Sampler()(logits, [row(min_tokens=2, output=[1])] * 3000)
    assert EOS not in blocked.token_ids
    allowed = Sampler()(logits, [row(min_tokens=2, output=[1, 1])] * 3000)
    assert allowed.token_ids.count(EOS) > 2500


def test_min_tokens_mask_only_touches_its_rows() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0]]).repeat(2, 1)
    rows = [row(temperature=0.0, min_tokens=4), row(temperature=0.0)]
    assert Sampler()(logits, rows).token_ids == [1, EOS]
    masked = process_logits(logits, rows)
    assert masked[0, EOS] == float("-inf") and masked[1, EOS] == 5.0


def test_empty_stop_set_means_nothing_to_mask() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    rows = [row(temperature=0.0, min_tokens=4, stop=frozenset())]
    assert Sampler()(logits, rows).token_ids == [EOS]


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(5, 50, seed=4)
    rows = [
        row(temperature=0.0, logprobs=0),
        row(temperature=1.0, logprobs=5),
        row(temperature=0.6, top_p=0.9, logprobs=3, generator=seeded(1)),
        row(temperature=1.0),
        # Penalties, masking and temperature change the sampling, never the logprobs.
        row(
            temperature=1.8,
            logprobs=20,
            output=[int(logits[4].argmax())],
            min_tokens=5,
            repetition_penalty=1.9,
            presence_penalty=2.0,
        ),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[3] is None
    for i, lp in enumerate(out.logprobs):
        if i == 3:
            continue
        assert lp is not None
        token = out.token_ids[i]
        n = rows[i].params.logprobs
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(reference[i, token]), abs=1e-5)
        assert lp.rank == 1 + int((reference[i] > reference[i, token]).sum())
        order = reference[i].argsort(descending=True)[:n]
        assert lp.top_token_ids == order.tolist()
        assert lp.top_logprobs == pytest.approx(reference[i, order].tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert out.logprobs[0].rank == 1 and out.logprobs[0].top_token_ids == []


def test_logprobs_of_a_masked_greedy_row_keep_the_raw_values() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    out = Sampler()(logits, [row(temperature=0.0, min_tokens=1, logprobs=2)])
    reference = torch.log_softmax(logits, dim=-1)[0]
    lp = out.logprobs[0]
    assert lp.token_id == 1 and lp.rank == 2
    assert lp.logprob == pytest.approx(float(reference[1]))
    assert lp.top_token_ids == [EOS, 1]


# ---------------------------------------------------------------------------------------------
# The caller's tensor


def test_logits_are_not_mutated() -> None:
    logits = random_logits(6, 40, seed=9)
    before = logits.clone()
    rows = [
        row(temperature=0.0, output=[1, 2], repetition_penalty=1.5, presence_penalty=1.0),
        row(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, output=[3], frequency_penalty=0.5),
        row(temperature=1.0, min_tokens=3, logprobs=4, generator=seeded(2)),
        row(temperature=0.0, min_tokens=2),
        row(temperature=1.3),
        row(temperature=0.0),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)
    Sampler()(logits, [row(temperature=0.0)] * 6)
    assert torch.equal(logits, before)


def test_rejects_logits_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 10), [row()] * 2)
