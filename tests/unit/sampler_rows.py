"""Sampling rows and logits shared by the sampler tests (test_sampler*.py)."""

from __future__ import annotations

import torch

from llmfleet.engine.sampler import SamplingRow
from llmfleet.shared.core.sampling_params import SamplingParams

EOS = 2


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
