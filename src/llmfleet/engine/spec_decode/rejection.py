"""Verification of draft tokens: which drafts the target model keeps, and its own next token.

A sequence with drafts x_1..x_d has d + 1 logits rows from one target forward pass: row j
(j = 0..d) is the target's distribution for the token after x_1..x_j. Each row is processed as
the sampler would process it at that output index (min_tokens masking of the stop ids while
num_output + j < min_tokens, then temperature, min_p, top_k, top_p: sampler.py), giving p_j.
Sequences with penalties, logprobs or structured output never get drafts, so nothing else
applies.

Greedy (temperature 0): draft x_{j+1} is kept while it equals argmax p_j; the token after the
kept drafts is argmax p_a at the first mismatch a (or the bonus argmax p_d when all are kept):
token for token what decoding without drafts gives.

Sampling (the standard exact scheme; Leviathan et al. 2023, Chen et al. 2023): with q_j the
distribution draft x_{j+1} was drawn from (one-hot for a deterministic proposer), x_{j+1} is
kept with probability min(1, p_j(x) / q_j(x)); at the first rejection a the token is drawn from
normalize(max(p_a - q_a, 0)), and when all d are kept from p_d. Each emitted token then follows
the target's distribution exactly, whatever the drafts. A seeded sequence draws its d uniforms
and then the V exponentials of the final token's race from its own generator, so a seeded run
is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmfleet.engine.sampler import (
    SamplingRow,
    greedy_ids,
    probabilities,
    race,
    select_rows,
    small_tensor,
)


@dataclass
class Verify:
    """One sequence's drafts to verify against its d + 1 consecutive logits rows."""

    row: SamplingRow  # the sequence as it stands (before the drafts)
    drafts: list[int]
    # (d, V) float32: row j the distribution draft j was drawn from; None: one-hot drafts.
    draft_probs: torch.Tensor | None = None


def rejection_sample(logits: torch.Tensor, seqs: Sequence[Verify]) -> list[list[int]]:
    """For each sequence, the tokens it emits: its kept drafts, then one token of the target's
    (1 to d + 1 tokens). `logits` is (sum(d + 1), V) float32, sequence i's rows consecutive in
    order; it is not written to."""
    counts = [len(s.drafts) + 1 for s in seqs]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"logits must be ({sum(counts)}, V), got {tuple(logits.shape)}")
    logits = _mask_min_tokens(logits.float(), seqs)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    out: list[list[int]] = [[] for _ in seqs]
    greedy = [i for i, s in enumerate(seqs) if s.row.params.temperature == 0.0]
    if greedy:
        rows = [r for i in greedy for r in range(starts[i], starts[i + 1])]
        targets = greedy_ids(select_rows(logits, rows)).tolist()
        at = 0
        for i in greedy:
            out[i] = _accept_greedy(seqs[i].drafts, targets[at : at + counts[i]])
            at += counts[i]
    sampled = [i for i, s in enumerate(seqs) if s.row.params.temperature != 0.0]
    if sampled:
        rows = [r for i in sampled for r in range(starts[i], starts[i + 1])]
        rows_of = [seqs[i].row for i in sampled for _ in range(counts[i])]
        probs = probabilities(select_rows(logits, rows), rows_of)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # (R, V), each row sums to 1
        for i, tokens in zip(sampled, _sample([seqs[i] for i in sampled], probs), strict=True):
            out[i] = tokens
    return out


def _mask_min_tokens(logits: torch.Tensor, seqs: Sequence[Verify]) -> torch.Tensor:
    """The stop ids at -inf in each row whose output index is still below min_tokens (a copy
    when any row needs it)."""
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    at = 0
    for s in seqs:
        stops = [t for t in s.row.stop_token_ids if t < vocab_size]
        num_output = len(s.row.output_token_ids)
        for j in range(len(s.drafts) + 1):
            if stops and num_output + j < s.row.params.min_tokens:
                mask_rows += [at + j] * len(stops)
                mask_cols += stops
        at += len(s.drafts) + 1
    if not mask_rows:
        return logits
    out = logits.clone()
    out[mask_rows, mask_cols] = float("-inf")
    return out


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    for j, x in enumerate(drafts):
        if x != targets[j]:
            return drafts[:j] + [targets[j]]
    return drafts + [targets[len(drafts)]]


def _sample(seqs: Sequence[Verify], probs: torch.Tensor) -> list[list[int]]:
    """Rejection sampling of sampled sequences over their `(sum(d + 1), V)` normalized target
    probabilities (see the module docstring)."""
    device = probs.device
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s.drafts) + 1)
    draft_rows = [starts[i] + j for i, s in enumerate(seqs) for j in range(len(s.drafts))]
    draft_ids = [x for s in seqs for x in s.drafts]
    accepted: list[int] = [len(s.drafts) for s in seqs]  # drafts kept per sequence
    if draft_ids:
        rows_t = small_tensor(draft_rows, device)
        p_x = probs[rows_t, small_tensor(draft_ids, device)]  # (D,) target prob of each draft
        q_x = torch.cat([_draft_prob_of(s, device) for s in seqs])  # (D,)
        uniforms = torch.cat([_uniforms(s, device) for s in seqs])  # (D,)
        # Keep with probability min(1, p / q): u < p / q, compared as u * q < p.
        keep = (uniforms * q_x < p_x).tolist()
        at = 0
        for i, s in enumerate(seqs):
            d = len(s.drafts)
            rejected = [j for j in range(d) if not keep[at + j]]
            accepted[i] = rejected[0] if rejected else d
            at += d
    # The final token: from normalize(max(p_a - q_a, 0)) after a rejection at a, else p_d.
    final = probs[small_tensor([starts[i] + a for i, a in enumerate(accepted)], device)]
    rejected = [i for i, s in enumerate(seqs) if accepted[i] < len(s.drafts)]
    if rejected:
        vocab_size = final.shape[1]
        q = torch.stack([_draft_row(seqs[i], accepted[i], vocab_size, device) for i in rejected])
        index = small_tensor(rejected, device)
        residual = (final[index] - q).clamp_min_(0.0)  # (N, V)
        # (p == q leaves nothing, but then the draft is always kept: a rounding guard)
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        final[index] = torch.where(has_mass, residual, final[index])
    tokens = race(final, [s.row.generator for s in seqs]).tolist()
    return [s.drafts[: accepted[i]] + [tokens[i]] for i, s in enumerate(seqs)]


def _draft_prob_of(s: Verify, device: torch.device) -> torch.Tensor:
    """(d,) q_j(x_{j+1}): the probability each draft had under its draft distribution."""
    d = len(s.drafts)
    if s.draft_probs is None:
        return torch.ones(d, device=device)
    q = s.draft_probs.to(device, torch.float32)
    return q[torch.arange(d, device=device), torch.tensor(s.drafts, device=device)]


def _draft_row(s: Verify, j: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(V,) q_j: the distribution draft j was drawn from."""
    if s.draft_probs is None:
        q = torch.zeros(vocab_size, device=device)
        q[s.drafts[j]] = 1.0
        return q
    return s.draft_probs[j].to(device, torch.float32)


def _uniforms(s: Verify, device: torch.device) -> torch.Tensor:
    """(d,) U[0, 1) draws, from the sequence's generator when it has one."""
    d = len(s.drafts)
    if s.row.generator is not None:
        return torch.rand(d, generator=s.row.generator, device=s.row.generator.device).to(device)
    return torch.rand(d, device=device)
