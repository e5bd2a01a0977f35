"""Choosing a draft token from a proposer's logits: the argmax for a greedy request, else a
draw from the distribution the sampler would draw the target's token from (temperature, min_p,
top_k, top_p; the request's generator when seeded), whose row becomes the draft's q for
rejection sampling (proposer.py `last_draft_probs`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmfleet.engine.request import Request
from llmfleet.engine.sampler import SamplingRow, greedy_ids, probabilities, race, small_tensor


def pick_tokens(
    logits: torch.Tensor,  # (n, V) float32
    reqs: Sequence[Request],  # row i's request
    q: list[list[torch.Tensor]],  # per proposer row: the (V,) q of each draft drawn so far
    at: Sequence[int],  # row i's index into q
) -> torch.Tensor:  # (n,) int64 on the logits' device
    """Row i's draft token; a drawn row's distribution (normalized) is appended to q[at[i]]."""
    tokens = greedy_ids(logits)
    drawn = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
    if not drawn:
        return tokens
    index = small_tensor(drawn, logits.device)
    probs = probabilities(logits[index].float(), [SamplingRow.of(reqs[i]) for i in drawn])
    probs = probs / probs.sum(dim=-1, keepdim=True)  # (D, V)
    tokens[index] = race(probs, [reqs[i].generator for i in drawn])
    for p, i in enumerate(drawn):
        q[at[i]].append(probs[p])
    return tokens


def stacked_probs(
    q: list[list[torch.Tensor]], rows: Sequence[tuple[int, int]], num_reqs: int
) -> list[torch.Tensor | None] | None:
    """`last_draft_probs` for a propose call: rows are (index in reqs, drafts given) per
    proposer row; None when no draft was drawn."""
    out: list[torch.Tensor | None] = [None] * num_reqs
    for r, (i, k) in enumerate(rows):
        if q[r]:
            out[i] = torch.stack(q[r][:k])  # (k, V)
    return out if any(p is not None for p in out) else None
