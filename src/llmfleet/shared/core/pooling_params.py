"""How an embedding request pools a prompt's hidden states (the engine's `Pooler`, the API).

`pooling` "last" takes the last token's final-norm hidden state, "mean" the mean over every
prompt token (the defaults of vLLM for decoder LMs: "last", normalized). `dimensions` keeps the
first values of the vector before normalizing: only meaningful for a model trained with
Matryoshka representation learning, which the engine checks against the model's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmfleet.shared.core.errors import ValidationError

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    dimensions: int | None = None  # None: the whole hidden state

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValidationError("pooling", f"must be one of {', '.join(POOLINGS)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValidationError("dimensions", f"must be at least 1, got {self.dimensions}")


def check_dimensions(
    dimensions: int | None, hidden_size: int, matryoshka: bool, allowed: tuple[int, ...] = ()
) -> None:
    """ValidationError naming `dimensions` unless the model can shorten its embeddings to it:
    it was trained for it (`matryoshka`; `allowed`: the sizes it was trained at, empty: any)
    and the size is at most its hidden size."""
    if dimensions is None:
        return
    if not matryoshka:
        raise ValidationError(
            "dimensions", "the model does not support matryoshka representations (dimensions)"
        )
    if not 1 <= dimensions <= hidden_size:
        raise ValidationError(
            "dimensions", f"must be between 1 and the hidden size {hidden_size}, got {dimensions}"
        )
    if allowed and dimensions not in allowed:
        raise ValidationError(
            "dimensions",
            f"{dimensions} is not one of the model's matryoshka dimensions "
            f"{', '.join(map(str, allowed))}",
        )
