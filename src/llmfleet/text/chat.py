"""Prompt construction: chat messages through the model's own chat template, and raw prompts.

Special tokens are added once. Chat templates usually write BOS themselves (`{{ bos_token }}`)
and some do not; a raw prompt has none. Both paths encode the text without special tokens and
then put in front the prefix the tokenizer's own `add_special_tokens=True` would add (BOS for
Llama-style tokenizers, nothing for GPT-2-style ones), unless the text already starts with it.
Suffixes a tokenizer may add (EOS) are left out: a prompt is continued, not ended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.tool_prompt import shape_for_template, template_support

ROLES = frozenset({"system", "user", "assistant", "tool"})


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles, contents and tool calls; returns plain dicts ({role, content} and, where
    set, `tool_calls` [{id, name, arguments}], `tool_call_id`, `name`). A content is a string,
    or a list of parts with images (`_content`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValidationError("messages", "must be a list of messages")
    if not messages:
        raise ValidationError("messages", "must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValidationError(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValidationError(
                f"messages[{i}].role", f"must be one of {sorted(ROLES)}, got {role!r}"
            )
        out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), i, role)}
        calls = message.get("tool_calls") or ()
        if calls and role != "assistant":
            raise ValidationError(f"messages[{i}].tool_calls", "only assistant messages have them")
        for j, call in enumerate(calls):
            if not isinstance(call, Mapping) or not call.get("name"):
                raise ValidationError(f"messages[{i}].tool_calls[{j}]", "must name a function")
            if not isinstance(call.get("arguments", ""), str):
                raise ValidationError(
                    f"messages[{i}].tool_calls[{j}].arguments", "must be JSON text"
                )
        if calls:
            out["tool_calls"] = [dict(c) for c in calls]
        for key in ("tool_call_id", "name"):
            if message.get(key):
                out[key] = message[key]
        checked.append(out)
    return checked


def _content(content: Any, i: int, role: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or a list of text and image parts. A list without
    images is joined into one string (what text-only templates expect); one with images stays
    a list of {"type": "text", "text"} and {"type": "image", "image": ImageSource} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise ValidationError(f"messages[{i}].content", "must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), ImageSource):
            if role != "user":
                raise ValidationError(where, f"images are accepted in user messages, not {role}")
            parts.append({"type": "image", "image": part["image"]})
        else:
            raise ValidationError(where, "must be a text part or an image part")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_images(messages: Sequence[Mapping[str, Any]]) -> list[tuple[ImageSource, str]]:
    """The image parts of validated messages, in order, with where each is
    (`messages[i].content[j]`)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m["content"], list):
            for j, part in enumerate(m["content"]):
                if part["type"] == "image":
                    out.append((part["image"], f"messages[{i}].content[{j}]"))
    return out


def chat_texts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Every text of validated messages with where it is (`messages[i].content[j]` for a part)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m["content"], str):
            out.append((m["content"], f"messages[{i}].content"))
        else:
            for j, part in enumerate(m["content"]):
                if part["type"] == "text":
                    out.append((part["text"], f"messages[{i}].content[{j}]"))
    return out


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Image parts as HF chat templates expect them: {"type": "image"} (the source left out)."""
    return [
        {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The prompt text the model's chat template makes of `messages` and `tools` ({name,
    description, parameters}); tool_prompt.py shapes them for templates that ignore tools."""
    checked = _for_template(validate_messages(messages))
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValidationError("messages", "model has no chat template")
    if not isinstance(template, str):  # several named templates: the default one
        template = template.get("default", "") if isinstance(template, Mapping) else ""
    shaped, template_tools = shape_for_template(template_support(template), checked, tools)
    try:
        return tokenizer.apply_chat_template(
            shaped,
            tools=template_tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        # Templates reject conversations they cannot render with raise_exception(...), e.g.
        # "roles must alternate user/assistant": that is a bad request, not a server fault.
        raise ValidationError("messages", f"rejected by the chat template: {e}") from e


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """Token ids of `render_chat(...)`, with the tokenizer's BOS exactly once if it uses one."""
    text = render_chat(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    return encode_rendered(tokenizer, text)


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat prompt, with the tokenizer's BOS exactly once."""
    return _with_special_prefix(tokenizer, tokenizer.encode(text, add_special_tokens=False))


def tokenize_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a raw prompt, with the tokenizer's BOS exactly once if it uses one."""
    if not isinstance(text, str):
        raise ValidationError("prompt", "must be a string")
    if not text:
        raise ValidationError("prompt", "must not be empty")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValidationError("prompt", "tokenizes to no tokens")
    return _with_special_prefix(tokenizer, ids)


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids `encode(..., add_special_tokens=True)` puts in front of the text (often [BOS])."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _with_special_prefix(tokenizer: Any, ids: list[int]) -> list[int]:
    prefix = special_prefix(tokenizer)
    if prefix and ids[: len(prefix)] != prefix:
        return prefix + ids
    return ids
