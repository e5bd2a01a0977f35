"""Per-request sampling parameters and their validation.

`SamplingParams` checks what it can check alone in `__post_init__` (ranges of each value);
`check_against` checks what needs the serving limits (caps on `n` and `logprobs`, context
length, vocabulary). Both raise `ValidationError` naming the field as the public API spells it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.structured_output import StructuredOutput


@dataclass(frozen=True)
class SamplingLimits:
    """Serving-side caps, from the engine configuration."""

    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_token_ids: int = 1024  # checked per sampled token: a bound on that work


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics: over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI semantics: over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; 0: sampled token only; k: sampled + top-k
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # None: unconstrained
    # Speculative decoding for this request: None: the worker's default; False: never; True:
    # whenever the worker has a proposer (engine/spec_decode/).
    speculative: bool | None = None
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _require_int("n", self.n, lo=1)
        _require_int("max_tokens", self.max_tokens, lo=1)
        _require_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValidationError(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _require_float("temperature", self.temperature, 0.0, 2.0)
        _require_int("top_k", self.top_k, lo=-1)
        _require_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValidationError("top_p", f"must be in (0, 1], got {self.top_p}")
        _require_float("min_p", self.min_p, 0.0, 1.0)
        _require_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0)
        if self.repetition_penalty <= 0.0:
            raise ValidationError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
            )
        _require_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _require_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _require_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs, lo=0)
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValidationError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t, lo=0)
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValidationError("speculative", f"must be a boolean, got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against(
        self, limits: SamplingLimits, *, num_prompt_tokens: int, max_model_len: int
    ) -> None:
        """Check the parameters against serving limits and the prompt's length."""
        if self.n > limits.max_n:
            raise ValidationError("n", f"must be <= {limits.max_n}, got {self.n}")
        if self.logprobs is not None and self.logprobs > limits.max_logprobs:
            raise ValidationError(
                "logprobs", f"must be <= {limits.max_logprobs}, got {self.logprobs}"
            )
        if len(self.stop) > limits.max_stop_strings:
            raise ValidationError(
                "stop", f"at most {limits.max_stop_strings} stop strings, got {len(self.stop)}"
            )
        if len(self.stop_token_ids) > limits.max_stop_token_ids:
            raise ValidationError(
                "stop_token_ids",
                f"at most {limits.max_stop_token_ids} stop token ids, "
                f"got {len(self.stop_token_ids)}",
            )
        if num_prompt_tokens + self.max_tokens > max_model_len:
            raise ValidationError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({self.max_tokens}) = "
                f"{num_prompt_tokens + self.max_tokens} exceeds the context length "
                f"{max_model_len}",
            )


def _require_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValidationError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValidationError(name, f"must be <= {hi}, got {value}")


def _require_float(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValidationError(name, f"must be finite, got {value}")
    if value < lo or value > hi:
        raise ValidationError(name, f"must be in [{lo}, {hi}], got {value}")
