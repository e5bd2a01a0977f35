"""Speculative decoding settings (engine/spec_decode/): which proposer drafts tokens, how many
per step, and when the engine stops speculating.

A frozen dataclass validated on construction; errors name the field as `speculative.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfleet.shared.core.errors import ValidationError

METHODS = ("ngram", "draft", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft" | "eagle"
    num_speculative_tokens: int = 3  # drafts per sequence per step, at most
    model: str | None = None  # draft model / EAGLE head checkpoint dir (draft and eagle)
    ngram_min: int = 1  # prompt-lookup n-gram sizes, longest match first
    ngram_max: int = 4
    # Speculate only while at most this many sequences run (None: always).
    disable_batch_size: int | None = None
    # method draft: run only the draft model's first N decoder layers (a layer-truncated
    # draft; with `model` the target's own checkpoint, its weights are shared). None: all.
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValidationError(
                "speculative.method", f"must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValidationError(
                "speculative.num_speculative_tokens",
                f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
            )
        if self.method in ("draft", "eagle") and not self.model:
            raise ValidationError(
                "speculative.model", f"method {self.method} needs a checkpoint directory"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValidationError("speculative.model", "method ngram takes no model")
        if not 1 <= self.ngram_min:
            raise ValidationError("speculative.ngram_min", f"must be >= 1, got {self.ngram_min}")
        if self.ngram_max < self.ngram_min:
            raise ValidationError(
                "speculative.ngram_max",
                f"must be >= ngram_min ({self.ngram_min}), got {self.ngram_max}",
            )
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ValidationError(
                "speculative.disable_batch_size",
                f"must be >= 1 or unset, got {self.disable_batch_size}",
            )
        if self.draft_layers is not None and (self.method != "draft" or self.draft_layers < 1):
            raise ValidationError(
                "speculative.draft_layers",
                f"must be >= 1 and only with method draft, got {self.draft_layers}",
            )
