"""Chat rendering through the model's own template, prompt tokenization, message validation."""

from __future__ import annotations

from typing import Any

import pytest

from llmfleet.shared.core.errors import ValidationError
from llmfleet.text.chat import render_chat, tokenize_chat, tokenize_prompt

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Bonjour, ça va ? 世界 🎉"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "  spaces  \n\nand newlines "},
    ],
    [{"role": "user", "content": ""}],
]


def _template_ids(tokenizer: Any, messages: Any, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_matches_apply_chat_template(
    smollm2_tokenizer, messages: Any, add_generation_prompt: bool
) -> None:
    tok = smollm2_tokenizer
    text = render_chat(tok, messages, add_generation_prompt=add_generation_prompt)
    assert text == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tokenize_chat(tok, messages, add_generation_prompt=add_generation_prompt)
    assert ids == _template_ids(tok, messages, add_generation_prompt)
    assert tok.decode(ids) == text


def test_smollm2_chat_special_tokens_are_single_ids(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tokenize_chat(tok, CONVERSATIONS[0])
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == im_start
    assert ids.count(im_start) == 3  # default system prompt, user, generation prompt
    assert ids.count(im_end) == 2


def test_bos_from_template_is_not_doubled(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer  # template starts with {{ bos_token }}; encode also adds BOS
    ids = tokenize_chat(tok, CONVERSATIONS[0])
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert ids == _template_ids(tok, CONVERSATIONS[0], True)


def test_bos_is_added_when_template_lacks_it(make_byte_fallback_tokenizer) -> None:
    tok = make_byte_fallback_tokenizer(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    ids = tokenize_chat(tok, CONVERSATIONS[0], add_generation_prompt=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "[user] What is 2+2?\n"


def test_raw_prompt_gets_bos_only_where_the_tokenizer_adds_it(
    smollm2_tokenizer, byte_fallback_tokenizer
) -> None:
    text = "Once upon a time, 世界"
    smol = smollm2_tokenizer
    assert tokenize_prompt(smol, text) == smol.encode(text, add_special_tokens=True)
    assert smol.decode(tokenize_prompt(smol, text)) == text
    sp = byte_fallback_tokenizer
    ids = tokenize_prompt(sp, text)
    assert ids == [sp.bos_token_id, *sp.encode(text, add_special_tokens=False)]
    assert ids == sp.encode(text, add_special_tokens=True)
    # A prompt that already starts with BOS keeps exactly one.
    assert tokenize_prompt(sp, "<s>" + text).count(sp.bos_token_id) == 1


@pytest.mark.parametrize("prompt", ["", None, ["Hello"]])
def test_invalid_prompt_names_the_field(smollm2_tokenizer, prompt: Any) -> None:
    with pytest.raises(ValidationError) as err:
        tokenize_prompt(smollm2_tokenizer, prompt)
    assert err.value.field == "prompt"


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        (
            [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}],
            "messages[1].role",
        ),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": 5}], "messages[1].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
    ],
)
def test_invalid_messages_name_the_field(smollm2_tokenizer, messages: Any, field: str) -> None:
    for fn in (render_chat, tokenize_chat):
        with pytest.raises(ValidationError) as err:
            fn(smollm2_tokenizer, messages)
        assert err.value.field == field


def test_all_roles_are_accepted(byte_fallback_tokenizer) -> None:
    messages = [
        {"role": role, "content": f"{role} says hi"}
        for role in ("system", "user", "assistant", "tool")
    ]
    text = render_chat(byte_fallback_tokenizer, messages, add_generation_prompt=False)
    assert text == "<s>" + "".join(f"[{m['role']}] {m['content']}\n" for m in messages)


def test_model_without_chat_template(make_byte_fallback_tokenizer) -> None:
    tok = make_byte_fallback_tokenizer(chat_template=None)
    with pytest.raises(ValidationError) as err:
        render_chat(tok, CONVERSATIONS[0])
    assert (err.value.field, err.value.message) == ("messages", "model has no chat template")


def test_template_rejecting_the_conversation_is_a_validation_error(
    make_byte_fallback_tokenizer,
) -> None:
    tok = make_byte_fallback_tokenizer(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('conversation must start with a user message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert render_chat(tok, CONVERSATIONS[0]) == "What is 2+2?"
    with pytest.raises(ValidationError) as err:
        tokenize_chat(tok, [{"role": "assistant", "content": "hi"}])
    assert err.value.field == "messages"
    assert "must start with a user message" in err.value.message
