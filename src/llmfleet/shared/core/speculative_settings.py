"""A worker's speculative-decoding settings as its flags and `LLMFLEET_*` variables give them,
before the device is known: `SpeculativeSettings` (one field per flag, the field's name is the
flag's, `--speculative-method` -> `speculative_method`, env `LLMFLEET_SPECULATIVE_METHOD`).

`config(disable_batch_size)` builds the engine's `SpeculativeConfig` once the batch-size
threshold is resolved: "auto" needs the device (engine/spec_decode/threshold.py), so the worker
resolves it, never this module. Errors name the flag (`--ngram-max`), as the user typed it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative import METHODS, SpeculativeConfig

# SpeculativeConfig field -> the flag that sets it.
FLAG_OF = {
    "method": "--speculative-method",
    "num_speculative_tokens": "--num-speculative-tokens",
    "model": "--speculative-model",
    "ngram_min": "--ngram-min",
    "ngram_max": "--ngram-max",
    "disable_batch_size": "--speculative-disable-batch-size",
    "draft_layers": "--speculative-draft-layers",
}
HELP = {
    "speculative_method": "draft tokens and verify them in one forward pass: ngram (prompt "
    "lookup), draft (a small model of the same tokenizer, --speculative-model) or eagle (an "
    "EAGLE/EAGLE-3 head, --speculative-model); decode and unified workers only (default off)",
    "num_speculative_tokens": "tokens drafted per sequence per step, at most (default 3)",
    "speculative_model": "the draft model's or EAGLE head's checkpoint directory",
    "speculative_draft_layers": "draft: run only the draft model's first N layers (a "
    "layer-truncated draft; with --speculative-model the served checkpoint, its weights are "
    "shared) (default: all)",
    "ngram_min": "ngram: the shortest suffix looked up in the sequence (default 1)",
    "ngram_max": "ngram: the longest suffix looked up, tried first (default 4)",
    "speculative_disable_batch_size": "speculate only while at most N sequences run: auto "
    "(default: this device's measured threshold, or a cost model's), never (always speculate), "
    "or N",
}
# vLLM's spellings of the same settings, accepted as aliases.
ALIASES = {
    "ngram_min": ("--ngram-prompt-lookup-min",),
    "ngram_max": ("--ngram-prompt-lookup-max",),
    "speculative_disable_batch_size": ("--speculative-disable-by-batch-size",),
}
AUTO, NEVER = "auto", "never"


@dataclass(frozen=True)
class SpeculativeSettings:
    """Unset fields take SpeculativeConfig's defaults; nothing set but the method is needed."""

    speculative_method: str | None = None  # None: no speculation
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    speculative_disable_batch_size: str | None = None  # "auto" (None) | "never" | "N"
    speculative_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_method is None:
            given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
            if given:
                raise ValidationError(_flag(given[0]), "needs --speculative-method")
            return
        if self.speculative_method not in METHODS:
            raise ValidationError(
                "--speculative-method",
                f"must be one of {', '.join(METHODS)}, got {self.speculative_method!r}",
            )
        self.fixed_disable_batch_size()  # checks its spelling
        self.config(None)  # checks the rest, naming the flag

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    @property
    def auto_threshold(self) -> bool:
        return self.enabled and self.speculative_disable_batch_size in (None, AUTO)

    def fixed_disable_batch_size(self) -> int | None:
        """The threshold when given as a number; None for "never" (and for "auto": see
        `auto_threshold`)."""
        raw = self.speculative_disable_batch_size
        if raw is None or raw.strip().lower() in (AUTO, NEVER):
            return None
        try:
            value = int(raw, 0)
        except ValueError:
            value = 0
        if value < 1:
            raise ValidationError(
                "--speculative-disable-batch-size",
                f"must be auto, never or an integer >= 1, got {raw!r}",
            )
        return value

    def config(self, disable_batch_size: int | None) -> SpeculativeConfig | None:
        """The engine's config with this resolved threshold (None: always speculate); None
        without a method."""
        if self.speculative_method is None:
            return None
        values = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "model": self.speculative_model,
            "ngram_min": self.ngram_min,
            "ngram_max": self.ngram_max,
            "draft_layers": self.speculative_draft_layers,
        }
        try:
            return SpeculativeConfig(
                method=self.speculative_method,
                disable_batch_size=disable_batch_size,
                **{k: v for k, v in values.items() if v is not None},
            )
        except ValidationError as exc:
            field = exc.field.removeprefix("speculative.")
            raise ValidationError(FLAG_OF.get(field, exc.field), exc.message) from None

    def argv(self) -> list[str]:
        """The worker flags that give these settings (what `llmfleet up` passes on)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out += [_flag(f.name), str(value)]
        return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
