"""Anthropic's Messages API (`/v1/messages`): request bodies, conversions and objects, pure.

A request's `system` and `messages` become chat messages: text blocks joined (or, with a
user's `image` blocks, text and image parts in order: content.py); an assistant's
`tool_use` blocks its `tool_calls` ({id, name, arguments as JSON text}); a user's `tool_result`
blocks `tool` messages (in front of the user's text, which follows the results). `thinking`
blocks of earlier turns are dropped, as a template without thinking support would. Errors are
`{"type": "error", "error": {"type", "message"}}` with the HTTP status of the OpenAI-shaped
APIError they come from.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from llmfleet.client.messages import Usage
from llmfleet.services.gateway.content import anthropic_image
from llmfleet.services.gateway.errors import APIError, invalid
from llmfleet.services.gateway.tool_calls import ToolCall, whole_calls

# HTTP status -> Anthropic error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """What a prompt is made of (`/v1/messages/count_tokens` counts it)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[_Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format`: a JSON schema for the text
    # Our extra: speculative decoding for this request (false never drafts; unset: the
    # worker's default). Draft counts come back in `usage` (see `usage`).
    speculative: StrictBool | None = None


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def error_body(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def body_error(errors: Sequence[Any]) -> APIError:
    """A 400 naming the first invalid field of a body (pydantic's error list)."""
    if not errors:
        return invalid(None, "invalid request body")
    err = errors[0]
    path = ""
    for p in err.get("loc", ()):
        if isinstance(p, int):
            path += f"[{p}]"
        elif p.isidentifier() and not p[:1].isupper() and p not in ("str", "list", "dict"):
            path += f".{p}" if path else p
        else:
            break  # the member of a union pydantic tried
    message = err.get("msg", "invalid value")
    return invalid(path or None, f"{path}: {message}" if path else message)


# ---- requests -----------------------------------------------------------------------------


def _block_text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise invalid(f"{param}.text", f"{param}.text: must be a string")
    return block["text"]


def _texts(content: str | list[Any], param: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    out = []
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise invalid(f"{where}.type", f"{where}.type: expected a text block, got {kind!r}")
        out.append(_block_text(block, where))
    return "".join(out)


def _turn(i: int, m: _Message) -> list[dict[str, Any]]:
    """The chat messages of one Messages turn."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, when there are images
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if kind == "text":
            text.append(_block_text(block, where))
            parts.append({"type": "text", "text": text[-1]})
        elif kind == "image" and m.role == "user":
            parts.append(anthropic_image(block, where))
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(where, f"{where}: a tool_use block has a string id and name")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block["id"], "name": block["name"], "arguments": arguments})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{where}.tool_use_id", f"{where}.tool_use_id: must be a string")
            body = _texts(block.get("content") or "", f"{where}.content")
            if block.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "content": body, "tool_call_id": block["tool_use_id"]})
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise invalid(
                f"{where}.type",
                f"{where}.type: {kind!r} blocks are not supported in {m.role} messages",
            )
    out = list(results)
    images = len(parts) > len(text)
    if text or images or not results:
        turn: dict[str, Any] = {"role": m.role, "content": parts if images else "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _texts(req.system, "system")})
    for i, m in enumerate(req.messages):
        out.extend(_turn(i, m))
    return out


def part_origins(req: CountTokensRequest) -> dict[str, str]:
    """Where each chat message's content came from, keyed by its path in GenerateRequest
    (`chat.messages[k].parts[p]`, `chat.messages[k].content`): the fleet names a bad image or
    text by that path, and the error then names the request's block (`messages[i].content[j]`)
    though `system` and `tool_result` blocks shift the chat's message indices."""
    out: dict[str, str] = {}
    k = 1 if req.system else 0
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out[f"chat.messages[{k}].content"] = f"messages[{i}].content"
            k += 1
            continue
        kinds = [b.get("type") if isinstance(b, dict) else None for b in m.content]
        k += kinds.count("tool_result") if m.role == "user" else 0
        shown = [
            j for j, t in enumerate(kinds) if t == "text" or (t == "image" and m.role == "user")
        ]
        images = any(kinds[j] == "image" for j in shown)
        if shown or kinds.count("tool_result") == 0 or m.role != "user":
            if images:
                for p, j in enumerate(shown):
                    out[f"chat.messages[{k}].parts[{p}]"] = f"messages[{i}].content[{j}]"
            out[f"chat.messages[{k}].content"] = f"messages[{i}].content"
            k += 1
    return out


def tools(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The client tools as {name, description, parameters}."""
    out = []
    for i, t in enumerate(req.tools or ()):
        if t.get("type") not in (None, "custom"):
            raise invalid(
                f"tools[{i}].type",
                f"tools[{i}].type: server tools ({t.get('type')!r}) are not supported",
            )
        out.append(
            {
                "name": t.get("name"),
                "description": t.get("description") or "",
                "parameters": t.get("input_schema"),
            }
        )
    return out


def tool_choice(req: CountTokensRequest) -> tuple[str | dict[str, Any] | None, bool]:
    """(tool_choice as Chat Completions spells it, parallel calls allowed)."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name", "tool_choice.name: must name one of the tools")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    by_kind = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in by_kind:
        raise invalid("tool_choice.type", "tool_choice.type: must be auto, any, tool or none")
    return by_kind[kind], parallel


# ---- responses ----------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: ToolCall | str) -> str:
    """Anthropic's spelling of a call id (`toolu_...`)."""
    raw = call if isinstance(call, str) else call.id
    return f"toolu_{raw.removeprefix('call_')}"


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:  # cut short by max_tokens: the input is what parsed
        arguments = {}
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": arguments}


def stop_reason(finish_reason: str | None, stop_string: str, calls: Sequence[ToolCall]) -> str:
    """ "tool_use" once the output holds whole calls (a grammar may let the model pad them with
    whitespace up to max_tokens); "max_tokens" when it ran out before."""
    if whole_calls(calls):
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if stop_string:
        return "stop_sequence"
    return "end_turn"


def usage(u: Usage | None, input_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage; with drafted tokens (speculative decoding, docs/fleet.md) their
    counts beside it, our extra (Anthropic's usage has no details object)."""
    if u is None:
        return {"input_tokens": input_tokens, "output_tokens": 0}
    out = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}
    if u.num_draft_tokens:
        out["num_draft_tokens"] = u.num_draft_tokens
        out["num_accepted_tokens"] = u.num_accepted_tokens
    return out


def message(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    *,
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }
