"""A random Llama-style checkpoint on disk with a tokenizer that spells its whole vocabulary,
for benchmarks that load models as a worker does (safetensors shards, config, tokenizer, chat
template). Kept once written: a later run reuses it."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }} <|end_of_text|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)


def write_random_checkpoint(
    directory: Path, config: LlamaConfig, dtype: torch.dtype, device: str
) -> Path:
    """`config`'s model with random weights (seed 0, made on `device` in `dtype`) saved under
    `directory` in shards of at most 5 GB, with `word_tokenizer`'s tokenizer."""
    if (directory / "config.json").is_file():
        return directory
    set_special_ids(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="5GB")
    del model
    word_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def write_weightless_checkpoint(directory: Path, config: LlamaConfig) -> Path:
    """`config` and `word_tokenizer`'s tokenizer without weights: a checkpoint for
    `--load-format dummy` (shapes too large to write), needing no model package."""
    set_special_ids(config)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    word_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def set_special_ids(config: LlamaConfig) -> None:
    """bos and eos: the first two of the SPECIALS at the end of the vocabulary."""
    vocab = config.vocab_size
    config.bos_token_id, config.eos_token_id = vocab - len(SPECIALS), vocab - len(SPECIALS) + 1


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `vocab` ids: ids below the specials are the words `w0`, `w1`,
    ...; the last ids are SPECIALS (bos, eos, the chat markers); with CHAT_TEMPLATE."""
    words = {f"w{i}": i for i in range(vocab - len(SPECIALS))}
    words.update({s: vocab - len(SPECIALS) + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[1],
        additional_special_tokens=list(SPECIALS[2:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
