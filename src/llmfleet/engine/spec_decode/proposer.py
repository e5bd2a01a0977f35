"""The proposer interface of speculative decoding: what drafts tokens for the engine to verify.

Each step, before scheduling, the engine asks its proposer for up to `k` draft tokens per
decoding sequence (`propose`), continuing `req.all_token_ids`. The target model then scores
the sequence's last known token and its drafts in one forward pass and rejection sampling
(rejection.py) keeps a prefix of the drafts plus one token of the target's own, so the output
follows the target's distribution exactly, whatever the drafts were.

Draft distributions: a deterministic proposer (n-gram lookup, greedy drafting) leaves
`last_draft_probs` None: its draft distribution q is one-hot on each draft. A proposer that
samples its drafts sets `last_draft_probs` in `propose` to one entry per request of `reqs`:
None (one-hot drafts) or a (num_drafts, vocab) float32 tensor whose row j is the distribution
draft j was drawn from (on any device; it is read before the next `propose`). Exactness
needs q to be the distribution the draft was actually drawn from.

When `observe` is called: a proposer that overrides it sees every step the engine runs (no
decode step is then chained ahead on the device: async_scheduling.py), with one `Computed`
per scheduled sequence that is still running after the step; a sequence the step ended gets
`release` instead. A sequence can reach `propose` with tokens it never observed: a request
whose prompt KV was computed elsewhere (disaggregated prefill: its prompt and first token
arrive with the KV), so a proposer with state catches up from `req.all_token_ids` (a draft
model recomputes its own KV for them; hidden states of a step it never saw are not at hand).

Who mutates what: a proposer never changes a request; it keeps its own per-request state
(KV of a draft model, hidden states) keyed by `request_id`, which it advances in `observe`
and drops in `release`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmfleet.engine.request import Request


@dataclass
class Computed:
    """What one step computed for one scheduled request, once its tokens are appended."""

    request: Request
    start: int  # sequence index of the request's first input token this step
    # Input tokens of the step whose KV stays: a prefill chunk's all; a verified decode's
    # 1 + accepted drafts. They are req.all_token_ids[start : start + num_kept].
    num_kept: int
    # (num_kept, width) rows of the target's captured layers (`Proposer.hidden_layers`) for
    # those tokens: row j is the token at sequence index start + j, and predicts
    # req.all_token_ids[start + j + 1]. None when the proposer captures no layers.
    hidden: torch.Tensor | None = None


class Proposer(abc.ABC):
    # Target decoder layers whose outputs the runner captures for this proposer (EAGLE), in
    # the order they are concatenated (models/decoder.py `capture_layers`); () = none.
    hidden_layers: tuple[int, ...] = ()
    # Set by `propose` when the drafts were sampled (see the module docstring); None: one-hot.
    last_draft_probs: list[torch.Tensor | None] | None = None

    @abc.abstractmethod
    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        """Up to `k` draft tokens per request, continuing `req.all_token_ids` (fewer or none
        is fine)."""

    def observe(self, computed: Sequence[Computed]) -> None:  # noqa: B027 (optional hook)
        """Called after every step (prefill chunks and verified decodes alike) once the step's
        tokens are appended, with one `Computed` per scheduled request."""

    def release(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """The request ended or was preempted: drop its state."""
