"""The served model as the public API reports it (`GetModelInfo`) and as a worker registers
it with the router: identity, vocabulary, context length and the serving limits that requests
are checked against."""

from __future__ import annotations

from dataclasses import dataclass

from llmfleet.shared.core.errors import ValidationError


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int  # the serving context length (the engine's cap, not the checkpoint's)
    eos_token_ids: tuple[int, ...]
    max_n: int  # completions per request
    max_logprobs: int  # top logprobs per position
    block_size: int  # tokens per KV block (block hashes depend on it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if not self.model_id:
            raise ValidationError("model.model_id", "must not be empty")
        for name in ("vocab_size", "max_model_len", "max_n", "block_size"):
            if getattr(self, name) < 1:
                raise ValidationError(f"model.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValidationError("model.max_logprobs", "must be >= 0")
