"""Chat messages and function tools: plain dicts <-> their protobuf messages.

The dict shapes are those of `text/chat.py`: a message is {role, content} (content a string,
or a list of {"type": "text", "text"} and {"type": "image", "image": ImageSource} parts, which
travel as `ChatMessage.parts`) plus, where set,
`tool_calls` ([{id, name, arguments (JSON text)}]), `tool_call_id` and `name`; a tool is {name,
description, parameters (a JSON Schema as a dict)}. Errors name the field as the client library
spells it (`messages[1].tool_calls[0].arguments`, `tools[0].parameters`); the tokenizer service
prefixes them with `chat.`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.image_source import ImageSource
from llmfleet.v1 import common_pb2


def chat_messages_to_pb(messages: Sequence[Mapping[str, Any]]) -> list[common_pb2.ChatMessage]:
    if isinstance(messages, (str, bytes)):
        raise ValidationError("messages", "must be a list of {role, content} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValidationError(f"messages[{i}]", "must be a mapping with role and content")
        role, content = m.get("role", ""), m.get("content", "")
        if not isinstance(role, str):
            raise ValidationError(f"messages[{i}].role", "must be a string")
        parts = []
        if not isinstance(content, str):
            parts = _parts_to_pb(content, f"messages[{i}].content")
            content = ""
        pb = common_pb2.ChatMessage(
            role=role,
            content=content,
            tool_call_id=_text(m, "tool_call_id", f"messages[{i}]"),
            name=_text(m, "name", f"messages[{i}]"),
            parts=parts,
        )
        for j, call in enumerate(m.get("tool_calls") or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call, Mapping):
                raise ValidationError(where, "must be a mapping with name and arguments")
            pb.tool_calls.append(
                common_pb2.ToolCall(
                    id=_text(call, "id", where),
                    name=_text(call, "name", where),
                    arguments=_text(call, "arguments", where),
                )
            )
        out.append(pb)
    return out


def _parts_to_pb(content: Any, where: str) -> list[common_pb2.ContentPart]:
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise ValidationError(where, "must be a string or a list of text and image parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(common_pb2.ContentPart(text=part["text"]))
        elif kind == "image" and isinstance(part.get("image"), ImageSource):
            src = part["image"]
            image = (
                common_pb2.ImageInput(data=src.data)
                if src.data
                else common_pb2.ImageInput(url=src.url)
            )
            out.append(common_pb2.ContentPart(image=image))
        else:
            raise ValidationError(f"{where}[{j}]", "must be a text part or an image part")
    return out


def _parts_from_pb(parts: Iterable[common_pb2.ContentPart], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.WhichOneof("part")
        if kind == "text":
            out.append({"type": "text", "text": part.text})
        elif kind == "image" and part.image.WhichOneof("source") is not None:
            image = part.image
            if not (image.data or image.url):
                raise ValidationError(f"{where}[{j}].image", "the image is empty")
            source = ImageSource(data=image.data) if image.data else ImageSource(url=image.url)
            out.append({"type": "image", "image": source})
        else:
            raise ValidationError(f"{where}[{j}]", "set text, or image with data or url")
    return out


def chat_messages_from_pb(messages: Iterable[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The messages as dicts; a message's `parts` become its content list (an image part
    {"type": "image", "image": ImageSource}). Errors name `messages[i].parts[j]`."""
    out = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if m.parts:
            if m.content:
                raise ValidationError(f"messages[{i}].content", "leave empty when parts are set")
            content = _parts_from_pb(m.parts, f"messages[{i}].parts")
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def tools_to_pb(tools: Sequence[Mapping[str, Any]]) -> list[common_pb2.Tool]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ValidationError(f"tools[{i}]", "must be a mapping with name and parameters")
        parameters = t.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ValidationError(f"tools[{i}].parameters", "must be a JSON Schema object")
        out.append(
            common_pb2.Tool(
                name=_text(t, "name", f"tools[{i}]"),
                description=_text(t, "description", f"tools[{i}]"),
                parameters=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return out


def tools_from_pb(tools: Iterable[common_pb2.Tool]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not t.name:
            raise ValidationError(f"tools[{i}].name", "must not be empty")
        parameters: Any = None
        if t.parameters:
            try:
                parameters = json.loads(t.parameters)
            except json.JSONDecodeError as exc:
                raise ValidationError(f"tools[{i}].parameters", f"not JSON: {exc}") from None
            if not isinstance(parameters, dict):
                raise ValidationError(f"tools[{i}].parameters", "must be a JSON object")
        out.append({"name": t.name, "description": t.description, "parameters": parameters})
    return out


def _text(m: Mapping[str, Any], key: str, where: str) -> str:
    value = m.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValidationError(f"{where}.{key}", "must be a string")
    return value
