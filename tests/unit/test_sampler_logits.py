"""Sampler, what happens to the logits: repetition/presence/frequency penalties, the min_tokens
mask, logprobs from the raw logits, and the caller's tensor left untouched.

Exact values on small hand-made logits; how penalties change the sampled distribution is in
test_sampler.py.
"""

from __future__ import annotations

import pytest
import torch
from sampler_rows import EOS, random_logits, row, seeded

from llmfleet.engine.sampler import Sampler, process_logits

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
