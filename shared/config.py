"""Configuration: frozen dataclasses, validated on construction, one env-variable prefix.

Every field of a config part can be set from the environment as `LLMFLEET_<FIELD>` (upper
case); CLI flags override the environment. `from_env` reads the registry; nothing else in the
code base reads `LLMFLEET_*` variables directly.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from llmfleet.shared.errors import ValidationError

ENV_PREFIX = "LLMFLEET_"
T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    """The engine core of one worker (any role)."""

    model: str | None = None  # HF checkpoint dir or .gguf file; None: the bundled SmolLM2
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    block_size: int = 16
    # KV cache size: an explicit block count wins; otherwise `kv_cache_bytes` is divided by the
    # model's bytes per block.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    max_n: int = 16
    max_logprobs: int = 20
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValidationError(
                "dtype", f"must be float32, bfloat16 or float16, got {self.dtype}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValidationError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValidationError("kv_cache_bytes", "must be >= 1")
        if self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValidationError(
                "max_num_batched_tokens",
                f"must be >= block_size ({self.block_size}), got {self.max_num_batched_tokens}",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.max_n < 1 or self.max_logprobs < 0:
            raise ValidationError("max_n", "max_n must be >= 1 and max_logprobs >= 0")

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build config `cls` from `LLMFLEET_*` variables, then `overrides` (None values ignored)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = ENV_PREFIX + f.name.upper()
        if key in env:
            values[f.name] = _parse(f.name, env[key], hints[f.name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def _parse(name: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and raw.strip().lower() in ("", "none"):
        return None
    try:
        if base is bool:
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if base is int:
            return int(raw, 0)
        if base is float:
            return float(raw)
        if base is str or isinstance(base, types.UnionType):
            return raw
    except ValueError:
        raise ValidationError(name, f"cannot parse {ENV_PREFIX}{name.upper()}={raw!r}") from None
    return raw
