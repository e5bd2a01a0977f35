"""Speculative decoding: proposers draft tokens, one target forward pass verifies them and
rejection sampling keeps the target's distribution exactly (proposer.py, rejection.py)."""

from __future__ import annotations

from typing import Any

from llmfleet.engine.spec_decode.proposer import Computed, Proposer
from llmfleet.models.loader import LoadedModel
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative import SpeculativeConfig

__all__ = ["Computed", "Proposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig, target: LoadedModel, engine_config: Any) -> Proposer:
    """The proposer `config` asks for, drafting for `target` (the engine's loaded model) on
    `engine_config`'s device and dtype."""
    if config.method == "ngram":
        from llmfleet.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.method == "draft":
        from llmfleet.engine.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer.build(config, target, engine_config)
    if config.method == "eagle":
        from llmfleet.engine.spec_decode.eagle import EagleProposer

        return EagleProposer.build(config, target, engine_config)
    raise ValidationError(
        "speculative.method", f"{config.method} speculation is not available in this build"
    )
