"""The Responses API's (`/v1/responses`) request body and objects, as pure functions.

A request's `input` (a string, or a list of items: messages, `function_call` and
`function_call_output`) becomes chat messages — `{"role", "content"}`, an assistant turn's
`tool_calls` (`{"id", "name", "arguments"}`), a tool turn's `tool_call_id` — which is also the
form the store keeps a conversation in (responses_store.py). `instructions` become a system
message in front, for this request only (a continued conversation does not inherit them, as
OpenAI documents). Output items are OpenAI's: a `message` of `output_text` content, and a
`function_call` per tool call.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool

from llmfleet.client.messages import Usage
from llmfleet.services.gateway.errors import APIError, invalid
from llmfleet.services.gateway.tool_calls import ToolCall, whole_calls

# Message roles of input items; "developer" is read as "system".
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    # vLLM's sampling extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    # Speculative decoding for this request: false never drafts; unset: the worker's default.
    speculative: StrictBool | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's 404 for an unknown (never stored, expired or deleted) response id."""
    if param == "previous_response_id":
        message = f"Previous response with id '{response_id}' not found."
        code = "previous_response_not_found"
    else:
        message = f"Response with id '{response_id}' not found."
        code = "not_found"
    return APIError(404, message, param=param, code=code)


# ---- input --------------------------------------------------------------------------------


def _text(content: Any, param: str) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"{param}: must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(
                f"{param}[{j}]",
                f"{param}[{j}]: only text content parts are supported, got type {kind!r}",
            )
        out.append(part["text"])
    return "".join(out)


def _field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{param}.{name}", f"{param}.{name}: must be a string")
    return value


def input_messages(items: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; consecutive function calls are one turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"{param}.role", f"{param}.role: must be one of {sorted(_ROLES)}")
            text = _text(item.get("content"), f"{param}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", param),
                "name": _field(item, "name", param),
                "arguments": _field(item, "arguments", param),
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{param}.output")
            call_id = _field(item, "call_id", param)
            out.append({"role": "tool", "content": output, "tool_call_id": call_id})
        else:
            raise invalid(
                f"{param}.type",
                f"{param}.type: input items of type {kind!r} are not "
                "supported (message, function_call, function_call_output are)",
            )
    if not out:
        raise invalid("input", "input: must hold at least one item")
    return out


def function_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's function tools as {name, description, parameters}."""
    out = []
    for i, tool in enumerate(req.tools or ()):
        if tool.get("type") != "function":
            raise invalid(
                f"tools[{i}].type",
                f"tools[{i}].type: only function tools are served, got {tool.get('type')!r}",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].name", f"tools[{i}].name: must be a non-empty string")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"tools[{i}].parameters", f"tools[{i}].parameters: must be an object")
        out.append(
            {
                "name": name,
                "description": tool.get("description") or "",
                "parameters": params or {"type": "object", "properties": {}},
            }
        )
    return out


def tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    """`tool_choice` in the Chat Completions form tools.py reads."""
    choice = req.tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", "tool_choice: must be auto, none, required or a function")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid("tool_choice", 'tool_choice: must be {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


# ---- output -------------------------------------------------------------------------------


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; `text` None: opened, no content part yet (streaming)."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text)],
    }


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str):
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn of the stored conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
        for item in output
        if item["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def usage(u: Usage | None) -> dict[str, Any] | None:
    """OpenAI's usage object; with drafted tokens (speculative decoding, docs/fleet.md) their
    counts in `output_tokens_details`, as chat's `completion_tokens_details` has them."""
    if u is None:
        return None
    details: dict[str, int] = {"reasoning_tokens": 0}
    if u.num_draft_tokens:
        details["num_draft_tokens"] = u.num_draft_tokens
        details["num_accepted_tokens"] = u.num_accepted_tokens
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": details,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def status_of(
    finish_reason: str | None, calls: Sequence[ToolCall]
) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details) of a response whose completion ended so."""
    if finish_reason == "length" and not whole_calls(calls):
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    req: ResponsesRequest,
    response_id: str,
    model: str,
    *,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    incomplete_details: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice,
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
    }
