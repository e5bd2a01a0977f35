"""Benchmark prompts: `random`, `prefix-repetition` and ShareGPT-format files.

Every generator is deterministic for a given `seed` and returns `SampleRequest`s whose
`expected_output_len` is the number of tokens to ask for (sent as `max_tokens` with
`ignore_eos`, so a well-behaved server returns exactly that many).

Prompts come in one of two forms, chosen by the caller through `as_text`:
- token ids (`list[int]`): sent as such over gRPC; `prompt_len` is exact;
- text: the ids decoded by the served model's tokenizer, for HTTP backends. Decoding and
  re-encoding does not always round-trip, so the text is re-encoded and trimmed or topped up
  a few times until it encodes to the wanted length; `prompt_len` is its encoded length then.

Token ids are drawn uniformly from the tokenizer's vocabulary less its special tokens, so a
random prompt never contains an end-of-sequence or chat-template marker.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmfleet.shared.core.errors import ValidationError

logger = logging.getLogger(__name__)

DATASETS = ("random", "prefix-repetition", "sharegpt")
# ShareGPT filtering: conversations this short say nothing about a server; longer ones would
# not fit common context lengths (prompt + output tokens).
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_TOTAL_TOKENS = 2048
_TEXT_FIT_ROUNDS = 4


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: `prompt` is token ids or text (see the module docstring)."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


class Tokenizer(Protocol):
    """What dataset generation needs of a tokenizer (`HFTokenizer` adapts a HF one)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def sampleable_ids(self) -> list[int]: ...


class HFTokenizer:
    """A `transformers` tokenizer seen through the `Tokenizer` protocol.

    `vocab_limit` caps ids (a served model's vocabulary may be smaller than the tokenizer's).
    """

    def __init__(self, tokenizer: Any, vocab_limit: int | None = None) -> None:
        self._tok = tokenizer
        self._limit = len(tokenizer) if vocab_limit is None else min(len(tokenizer), vocab_limit)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def sampleable_ids(self) -> list[int]:
        special = set(self._tok.all_special_ids)
        return [i for i in range(self._limit) if i not in special]


def uniform_lengths(
    rng: random.Random, n: int, length: int, range_ratio: float, field: str
) -> list[int]:
    """`n` integers uniform in [floor(length*(1-r)), floor(length*(1+r))], each at least 1."""
    if length < 1:
        raise ValidationError(field, f"must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValidationError("--random-range-ratio", f"must be in [0, 1), got {range_ratio}")
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def _random_ids(rng: random.Random, pool: Sequence[int], n: int) -> list[int]:
    return rng.choices(pool, k=n)


def text_of_length(
    tokenizer: Tokenizer, ids: list[int], pool: Sequence[int], rng: random.Random
) -> tuple[str, int]:
    """Text that encodes to about `len(ids)` tokens, starting from `ids` decoded.

    Returns (text, its encoded length). Merges at decode/encode boundaries change the count, so
    the encoding is trimmed or topped up with fresh random ids for a few rounds.
    """
    target = len(ids)
    text = tokenizer.decode(ids)
    for _ in range(_TEXT_FIT_ROUNDS):
        encoded = tokenizer.encode(text)
        if len(encoded) == target:
            break
        if len(encoded) > target:
            encoded = encoded[:target]
        else:
            encoded += _random_ids(rng, pool, target - len(encoded))
        text = tokenizer.decode(encoded)
    return text, len(tokenizer.encode(text))


def _pool(tokenizer: Tokenizer) -> list[int]:
    pool = tokenizer.sampleable_ids()
    if not pool:
        raise ValidationError("--tokenizer", "has no non-special tokens to sample prompts from")
    return pool


def _num_prompts(n: int) -> int:
    if n < 1:
        raise ValidationError("--num-prompts", f"must be >= 1, got {n}")
    return n


def random_requests(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Prompts of random tokens; input and output lengths uniform around the given ones."""
    rng = random.Random(seed)
    n = _num_prompts(num_prompts)
    pool = _pool(tokenizer)
    in_lens = uniform_lengths(rng, n, input_len, range_ratio, "--random-input-len")
    out_lens = uniform_lengths(rng, n, output_len, range_ratio, "--random-output-len")
    out = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = _random_ids(rng, pool, in_len)
        if as_text:
            text, actual = text_of_length(tokenizer, ids, pool, rng)
            out.append(SampleRequest(text, actual, out_len))
        else:
            out.append(SampleRequest(ids, in_len, out_len))
    return out


def prefix_repetition_requests(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    as_text: bool = False,
) -> list[SampleRequest]:
    """`num_prompts` prompts, each one of `num_prefixes` shared random prefixes followed by its
    own random suffix; the prefixes are used equally often (round robin) and the prompts are
    shuffled, so requests sharing a prefix arrive interleaved with the others."""
    rng = random.Random(seed)
    n = _num_prompts(num_prompts)
    for name, value, minimum in (
        ("--prefix-repetition-prefix-len", prefix_len, 1),
        ("--prefix-repetition-suffix-len", suffix_len, 0),
        ("--prefix-repetition-num-prefixes", num_prefixes, 1),
        ("--prefix-repetition-output-len", output_len, 1),
    ):
        if value < minimum:
            raise ValidationError(name, f"must be >= {minimum}, got {value}")
    pool = _pool(tokenizer)
    prefixes = [_random_ids(rng, pool, prefix_len) for _ in range(num_prefixes)]
    prefix_texts = [text_of_length(tokenizer, p, pool, rng)[0] for p in prefixes] if as_text else []
    out = []
    for i in range(n):
        k = i % num_prefixes
        suffix = _random_ids(rng, pool, suffix_len)
        if as_text:
            suffix_text = text_of_length(tokenizer, suffix, pool, rng)[0] if suffix else ""
            text = prefix_texts[k] + suffix_text
            out.append(SampleRequest(text, len(tokenizer.encode(text)), output_len))
        else:
            out.append(SampleRequest(prefixes[k] + suffix, prefix_len + suffix_len, output_len))
    rng.shuffle(out)
    return out


def _first_exchange(entry: Any, i: int, path: Path) -> tuple[str, str] | None:
    """The first human turn and the gpt turn after it, or None when the entry has none."""
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise ValidationError(
            "--dataset-path", f"{path}: entry {i} has no 'conversations' list (ShareGPT format)"
        )
    turns = entry["conversations"]
    for j, turn in enumerate(turns[:-1]):
        nxt = turns[j + 1]
        if not isinstance(turn, dict) or not isinstance(nxt, dict):
            raise ValidationError(
                "--dataset-path", f"{path}: entry {i}: turns must be {{from, value}} objects"
            )
        if turn.get("from") == "human" and nxt.get("from") == "gpt":
            prompt, reply = turn.get("value"), nxt.get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                return prompt, reply
            return None
    return None


def sharegpt_requests(
    tokenizer: Tokenizer,
    path: str | Path,
    *,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts from a ShareGPT-format JSON file (always text).

    Each entry's first human turn is the prompt; the output length is the token count of the
    gpt turn answering it, or `output_len` when given. Entries with a prompt or answer shorter
    than SHAREGPT_MIN_TOKENS, or longer than SHAREGPT_MAX_TOTAL_TOKENS together, are skipped.
    Entries are shuffled with `seed` before the first `num_prompts` usable ones are taken.
    """
    n = _num_prompts(num_prompts)
    if output_len is not None and output_len < 1:
        raise ValidationError("--sharegpt-output-len", f"must be >= 1, got {output_len}")
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValidationError("--dataset-path", f"cannot read {p}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValidationError("--dataset-path", f"{p} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValidationError("--dataset-path", f"{p}: must hold a JSON list of conversations")
    exchanges = [x for i, e in enumerate(data) if (x := _first_exchange(e, i, p)) is not None]
    random.Random(seed).shuffle(exchanges)
    out: list[SampleRequest] = []
    for prompt, reply in exchanges:
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if prompt_len < SHAREGPT_MIN_TOKENS:
            continue
        if output_len is None and out_len < SHAREGPT_MIN_TOKENS:
            continue
        if prompt_len + out_len > SHAREGPT_MAX_TOTAL_TOKENS:
            continue
        out.append(SampleRequest(prompt, prompt_len, out_len))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValidationError(
            "--num-prompts",
            f"{p} has only {len(out)} usable conversations, {n} were asked for",
        )
    return out
