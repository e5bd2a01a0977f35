"""Loading a model's tokenizer alone (no weights), for the tokenizer service and the gateway.

Kept apart from server.py so that importing it registers no service metrics.
"""

from __future__ import annotations

from typing import Any

from llmfleet.shared.core.errors import ModelLoadError


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of `model` (HF directory or .gguf file; None: the bundled SmolLM2) alone,
    without its weights."""
    from llmfleet.models.checkpoint_files import resolve_model_path
    from llmfleet.models.tokenizer import dir_tokenizer, gguf_tokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        return dir_tokenizer(path)
    if path.suffix == ".gguf":
        return gguf_tokenizer(path)
    raise ModelLoadError(f"{path} is neither a checkpoint directory nor a .gguf file")
