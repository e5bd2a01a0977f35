"""A simulated model: a real checkpoint's tokenizer and KV geometry, a step-time model in place
of its weights, and a fixed rule for its next token.

A simulated worker (`--simulate`) runs the real engine (scheduler, block manager, prefix cache,
KV hooks) and the real services around it, so the control plane can be benchmarked, profiled
and tested at scale on a CPU. Only the forward pass is modelled: a step of a batch takes

    step_ms + decode_ms_per_seq * (sequences decoding one token)
            + prefill_ms_per_token * (prompt tokens computed)

milliseconds of wall time, spent asleep, so the engine thread leaves the CPU to the other
processes as it does while a GPU computes.

The model's next token is deterministic: after token `t` at position `p` it is
`ordinary_ids[(t * 1_000_003 + p * 7_919) % len(ordinary_ids)]`, where `ordinary_ids` is the
vocabulary without its special tokens (EOS among them). Its distribution is one-hot, so every
sampling method picks that token, its logprob is 0 and it is the only token with any
probability; a completion ends by its length limit, a stop token id or a stop string.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from llmfleet.shared.core.errors import ValidationError


@dataclass(frozen=True)
class StepTime:
    """Wall time of one simulated forward pass (see the module docstring); the values come
    from `EngineConfig.sim_*`, which checks them."""

    step_ms: float
    decode_ms_per_seq: float
    prefill_ms_per_token: float

    def seconds(self, query_lens: Sequence[int]) -> float:
        """A step whose sequence i computes `query_lens[i]` tokens (1: a decode token)."""
        decode = sum(1 for q in query_lens if q == 1)
        prefill = sum(q for q in query_lens if q > 1)
        ms = self.step_ms + self.decode_ms_per_seq * decode + self.prefill_ms_per_token * prefill
        return ms / 1e3


@dataclass(frozen=True)
class SimulatedModel:
    """Stands where a `CausalLM` would in a `LoadedModel`; the engine runs it with
    `engine.simulated.SimulatedRunner`, timed by the engine config's `StepTime`, and
    `SimulatedSampler`."""

    ordinary_ids: tuple[int, ...]  # the tokens it can produce: the vocabulary less specials

    def __post_init__(self) -> None:
        if not self.ordinary_ids:
            raise ValidationError("model", "the vocabulary has no ordinary tokens to simulate")

    def next_token(self, previous: int, position: int, masked: Collection[int] = ()) -> int:
        """The token after `previous` at `position`; with `masked` (ids the sampler may not
        pick), the first ordinary token from there on that is not masked."""
        ids = self.ordinary_ids
        i = (previous * 1_000_003 + position * 7_919) % len(ids)
        for j in range(len(ids)):
            token = ids[(i + j) % len(ids)]
            if token not in masked:
                return token
        raise ValueError("every ordinary token is masked")
