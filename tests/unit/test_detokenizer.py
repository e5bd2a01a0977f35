"""IncrementalDetokenizer: streamed deltas equal a full decode; stop strings cut exactly."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from llmfleet.shared.core.errors import ValidationError
from llmfleet.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "世界你好，这是一个测试。",
    "日本語のテキストと한국어 텍스트",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "héllo café naïve Ångström façade",
    "combining e\u0301 and o\u0308 marks",
    "mixed: abc 世界 🎉 é 123 Ωμέγα العربية",
    "   leading spaces",
    "runs   of    spaces\t\ttabs\n\n\nnewlines   ",
    " ",
    "a",
    "🎉",
]

TOKENIZERS = ["smollm2_tokenizer", "byte_fallback_tokenizer"]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(request, tokenizer_name: str, text: str) -> None:
    tokenizer = request.getfixturevalue(tokenizer_name)
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.stop_reason is None


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_text_after_prompt_equals_decode_in_context(
    request, tokenizer_name: str, chunk: int
) -> None:
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt = tokenizer.encode("Say something: ", add_special_tokens=True)
    for text in TEXTS:
        ids = _encode(tokenizer, text)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = _stream(detok, ids, chunk)
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
        full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert "".join(deltas) == full[len(prompt_text) :], text
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_emitted_whole_once_complete(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    ids = _encode(tok, "a🎉")
    assert [tok.convert_ids_to_tokens(i) for i in ids[-4:]] == [
        "<0xF0>",
        "<0x9F>",
        "<0x8E>",
        "<0x89>",
    ]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert deltas[-4:] == ["", "", "", "🎉"]


def test_byte_level_emoji_split_across_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = _encode(tok, "ok 🎉")
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert len(ids) > 2  # the emoji spans several byte-level tokens
    assert "".join(deltas) == "ok 🎉"
    assert any(d.endswith("🎉") for d in deltas)
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_leading_space_follows_context(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    world = _encode(tok, "world")  # ["▁world"] or pieces of it, first one starting with "▁"
    assert tok.convert_ids_to_tokens(world[0]).startswith("▁")
    alone = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(alone, world)) == "world"
    after_prompt = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert "".join(_stream(after_prompt, world)) == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(smollm2_tokenizer, skip: bool) -> None:
    tok = smollm2_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*_encode(tok, "Hi"), im_end, im_end, *_encode(tok, " there 世界"), im_end]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    text = "".join(_stream(detok, ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text == ("Hi there 世界" if skip else "Hi<|im_end|><|im_end|> there 世界<|im_end|>")


def test_special_tokens_between_sentencepiece_words_keep_the_space(
    byte_fallback_tokenizer,
) -> None:
    tok = byte_fallback_tokenizer
    eos = tok.eos_token_id
    ids = [*_encode(tok, "Hello"), eos, eos, eos, *_encode(tok, " world")[1:]]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(detok, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_window_stays_short_on_long_output(smollm2_tokenizer) -> None:
    class Recording:
        def __init__(self, tok: Any) -> None:
            self._tok = tok
            self.longest = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(self._tok, name)

        def __len__(self) -> int:
            return len(self._tok)

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return self._tok.decode(ids, **kwargs)

    tok = Recording(smollm2_tokenizer)
    ids = _encode(smollm2_tokenizer, " ".join(TEXTS) * 40)
    assert len(ids) > 3000
    detok = IncrementalDetokenizer(tok, _encode(smollm2_tokenizer, "prompt " * 100))
    assert "".join(_stream(detok, ids)) == smollm2_tokenizer.decode(ids)
    assert tok.longest <= 12


# ---- stop strings ----


def _run(
    tok: Any, text: str, stop: Sequence[str], include: bool = False, chunk: int = 1
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    ids = _encode(tok, text)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(request, tokenizer_name: str, include: bool) -> None:
    tok = request.getfixturevalue(tokenizer_name)
    text = "The quick brown fox jumps over the lazy dog."
    deltas, detok = _run(tok, text, ["brown fox"], include)
    assert len(_encode(tok, "brown fox")) > 1
    assert detok.stop_reason == "brown fox"
    expected = "The quick brown fox" if include else "The quick "
    assert "".join(deltas) == detok.text == expected
    # Nothing after the match: further tokens and finish() add no text.
    assert detok.add_tokens(_encode(tok, " more text")) == ""
    assert detok.finish() == ""
    assert detok.text == expected


def test_stop_text_is_never_emitted_early(smollm2_tokenizer) -> None:
    # "brown fo" is held back while it may still become "brown fox"; the deltas never show it.
    deltas, detok = _run(smollm2_tokenizer, "The quick brown fox", ["brown fox"])
    assert all("brown" not in d for d in deltas)
    assert detok.text == "The quick "


def test_stop_string_at_the_very_start(smollm2_tokenizer) -> None:
    deltas, detok = _run(smollm2_tokenizer, "The quick brown fox", ["The"])
    assert detok.stop_reason == "The"
    assert detok.text == "" and all(d == "" for d in deltas)
    deltas, detok = _run(smollm2_tokenizer, "The quick brown fox", ["The"], include=True)
    assert detok.text == "The"


def test_held_back_text_is_flushed_by_finish(smollm2_tokenizer) -> None:
    deltas, detok = _run(smollm2_tokenizer, "quick brown fox", ["fox!"])
    assert "".join(deltas) == "quick brown "  # "fox" might still become "fox!"
    assert detok.finish() == "fox"
    assert detok.text == "quick brown fox"
    assert detok.stop_reason is None


def test_text_that_cannot_start_a_stop_string_is_not_delayed(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, [], stop=["STOP", "###"])
    for word in ["Hello", " there", ",", " friend"]:
        (token_id,) = _encode(tok, word)
        assert detok.add_tokens([token_id]) == word


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    _, detok = _run(smollm2_tokenizer, text, ["dog", "fox", "lazy"])
    assert (detok.stop_reason, detok.text) == ("fox", "The quick brown ")
    # Overlapping stops: the one completed first wins, however the text was tokenized.
    for chunk in (1, 4, 100):
        _, detok = _run(smollm2_tokenizer, text, ["brown fox jumps", "fox"], chunk=chunk)
        assert (detok.stop_reason, detok.text) == ("fox", "The quick brown ")
        _, detok = _run(smollm2_tokenizer, text, ["quick brown", "brown"], chunk=chunk)
        assert (detok.stop_reason, detok.text) == ("quick brown", "The ")


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_stop_string_made_of_multibyte_characters(request, tokenizer_name: str) -> None:
    tok = request.getfixturevalue(tokenizer_name)
    deltas, detok = _run(tok, "abc 世界 🎉 end", ["界 🎉"], include=True)
    assert detok.stop_reason == "界 🎉"
    assert detok.text == "abc 世界 🎉"
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_in_the_prompt_does_not_match(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, _encode(tok, "END of prompt END"), stop=["END"])
    assert "".join(_stream(detok, _encode(tok, " answer"))) == " answer"
    assert detok.stop_reason is None


def _reference(full: str, stop: Sequence[str], include: bool) -> tuple[str, str | None]:
    found = [(full.find(s) + len(s), full.find(s), s) for s in stop if s in full]
    if not found:
        return full, None
    end, start, s = min(found)
    return (full[:end] if include else full[:start]), s


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_stop_strings_match_reference_on_random_cases(request, tokenizer_name: str) -> None:
    tok = request.getfixturevalue(tokenizer_name)
    rng = random.Random(1234)
    for _ in range(150):
        full = rng.choice(TEXTS) + " " + rng.choice(TEXTS)
        ids = _encode(tok, full)
        full = tok.decode(ids)
        stop = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                start = rng.randrange(len(full))
                stop.append(full[start : start + rng.randint(1, 6)])
            else:
                stop.append(rng.choice(["zzz", "🎉!", "\n\n\n\n"]))
        include = rng.random() < 0.5
        chunk = rng.choice([1, 1, 2, 5])
        detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
        deltas = _stream(detok, ids, chunk)
        expected_text, expected_stop = _reference(full, stop, include)
        assert ("".join(deltas), detok.stop_reason) == (expected_text, expected_stop), (
            full,
            stop,
        )


@pytest.mark.parametrize("stop", [[""], ["ok", ""], "STOP"])
def test_invalid_stop_strings_are_rejected(smollm2_tokenizer, stop: Any) -> None:
    with pytest.raises(ValidationError) as err:
        IncrementalDetokenizer(smollm2_tokenizer, [], stop=stop)
    assert err.value.field.startswith("stop")


def test_add_tokens_after_finish_is_an_error(smollm2_tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, [])
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.add_tokens([42])
