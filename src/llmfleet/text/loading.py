"""Loading a model's tokenizer alone (no weights), for the tokenizer service and the gateway.

Kept apart from server.py so that importing it registers no service metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmfleet.shared.core.errors import ModelLoadError


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of `model` (HF directory or .gguf file; None: the bundled SmolLM2) alone,
    without its weights."""
    from transformers import AutoTokenizer

    from llmfleet.models.loader import gguf_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(path)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{path}: cannot load its tokenizer: {exc}") from exc
    if Path(path).suffix == ".gguf":
        return gguf_tokenizer(path)
    raise ModelLoadError(f"{path} is neither a checkpoint directory nor a .gguf file")
