"""A cheap lower bound on a text's token count: refuse a prompt that cannot fit the context
without tokenizing it.

    per_token = max_bytes_per_token(tokenizer)      # once per tokenizer; None: no sound bound
    if per_token and min_num_tokens(text, per_token) > max_model_len: refuse

No token covers more than `per_token` bytes of the UTF-8 text, so a text of B bytes has at least
ceil(B / per_token) tokens. `per_token` is the longest vocabulary entry in input bytes (a
byte-level BPE piece spells one byte per character; other pieces are counted in UTF-8 bytes,
which is never less than what they cover), times what the normalizer may shrink the text by.
Tokenizers where a token can cover unboundedly much input (a fused or word-level unknown token,
an added token that swallows the whitespace around it, a normalizer that deletes characters)
get None: their prompts are only checked after tokenization.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Unicode normalization and case mapping shrink a text by at most this factor (a 4-byte code
# point becomes a 1-byte one, e.g. U+1D400 -> "A" under NFKC; Hangul jamo compose 9 -> 3 bytes).
_NORMALIZATION_SHRINK = 4
_SHRINKING = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_GROWING = frozenset({"Prepend", "Append"})


def min_num_tokens(text: str, per_token: int) -> int:
    """The fewest tokens `text` can have (sound given `per_token` from max_bytes_per_token)."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / per_token)


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most input bytes one token of `tokenizer` can cover; None when unbounded or unknown
    (a tokenizer that is not a Hugging Face fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    shrink = _shrink_factor(spec.get("normalizer"))
    model = spec.get("model") or {}
    if shrink is None or any(t.get("lstrip") or t.get("rstrip") for t in spec["added_tokens"]):
        return None
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(
        spec.get("decoder"), "ByteLevel"
    )
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        pieces = [entry[0] for entry in vocab]
    elif isinstance(vocab, dict):
        pieces = list(vocab)
    else:
        return None
    longest = max((_piece_bytes(p, byte_level) for p in pieces), default=1)
    longest = max([longest, *(len(t["content"].encode()) for t in spec["added_tokens"])])
    unknown = _unknown_span(model)
    if unknown is None:
        return None
    return max(longest, unknown) * shrink


def _unknown_span(model: dict[str, Any]) -> int | None:
    """Input bytes the model's unknown token can cover (0 without one); None: unbounded."""
    kind = model.get("type")
    if kind == "BPE":
        if model.get("unk_token") is None or model.get("byte_fallback"):
            return 0
        return None if model.get("fuse_unk") else 4  # one character
    if kind == "WordPiece":  # a whole word of up to this many characters
        return 4 * int(model.get("max_input_chars_per_word", 100))
    if kind == "Unigram" and model.get("unk_id") is None:
        return 0
    return None  # Unigram fuses unknown characters; WordLevel maps whole words


def _piece_bytes(piece: str, byte_level: bool) -> int:
    if byte_level and all(ord(ch) < 0x144 for ch in piece):  # GPT-2's byte alphabet
        return len(piece)
    return len(piece.encode("utf-8", "surrogatepass"))


def _shrink_factor(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _SHRINKING:
        return _NORMALIZATION_SHRINK
    if kind in _GROWING:
        return 1
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if pattern is None or not content:  # a regex or a deletion: no bound
            return None
        return max(1, math.ceil(len(pattern.encode()) / len(content.encode())))
    return None


def _has_type(component: dict[str, Any] | None, kind: str) -> bool:
    if not component:
        return False
    if component.get("type") == kind:
        return True
    parts = component.get("pretokenizers") or component.get("decoders") or []
    return any(_has_type(p, kind) for p in parts)
