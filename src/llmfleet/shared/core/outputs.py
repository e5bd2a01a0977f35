"""What generation produces, as every layer above the engine sees it: per-position logprobs
and one finished (or growing) completion. The engine, the wire conversions, the clients and
the in-process `LLM` all use these types."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one generated position, from the model's raw logits (before penalties,
    masking and temperature)."""

    token_id: int
    logprob: float  # of the sampled token
    rank: int  # 1 = most likely
    top_token_ids: list[int]  # top-N (N = SamplingParams.logprobs), most likely first
    top_logprobs: list[float]


@dataclass
class Completion:
    """One of a request's `n` completions; `finish_reason` is set once it has ended."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # empty unless requested
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_string: str = ""  # the stop string that ended it, if one did
    stop_token_id: int | None = None  # the stop token (from stop_token_ids) that ended it
