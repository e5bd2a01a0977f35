"""A checkpoint's tokenizer and the token ids that end a sequence.

An HF checkpoint directory carries its tokenizer files; a GGUF file carries its vocabulary in
its metadata, which transformers converts (slowly) into a tokenizer: that conversion is done
once per file and cached as HF files under `cache_dir_for(path)`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from llmfleet.models.checkpoint_files import cache_dir_for
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

# End-of-turn markers of common chat templates; one counts as EOS when the template uses it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def dir_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of an HF checkpoint directory."""
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{directory}: cannot load its tokenizer: {exc}") from exc


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file; converted once (slow) and cached as HF files."""
    cached = cache_dir_for(path) / "tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    logger.info("converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata: {exc}") from exc
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix="tokenizer."))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)  # atomic; a concurrent loader may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def dir_eos_ids(directory: Path, config: Any) -> list[int]:
    """The EOS ids an HF checkpoint directory's config and generation_config.json name."""
    ids = as_ids(getattr(config, "eos_token_id", None))
    if (directory / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(directory)
        ids += as_ids(gen.eos_token_id)
    return ids


def as_ids(value: Any) -> list[int]:
    """A config's token id field (None, one id or a list) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(config_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """`config_ids`, then the tokenizer's EOS and the end-of-turn markers its chat template
    uses, without repeats, in that order."""
    ids = config_ids + as_ids(tokenizer.eos_token_id)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template]
    return tuple(dict.fromkeys(ids))
