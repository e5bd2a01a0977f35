"""OpenAI's shapes of tool calls: an assistant message's calls read from a request, and the calls
of a response, whole (`message.tool_calls`) or streamed (`delta.tool_calls`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmfleet.services.gateway.errors import invalid
from llmfleet.services.gateway.tools import ToolCall, ToolCallDelta


def call_in(c: Any, where: str) -> dict[str, str]:
    """A tool call of an assistant message, {id, type, function: {name, arguments}}."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid(f"{where}.function.name", "must be the name of the function called")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):  # lenient: an object instead of its JSON text
        args = json.dumps(args)
    if not isinstance(args, str):
        raise invalid(f"{where}.function.arguments", "must be JSON text")
    call_id = c.get("id") or ""
    if not isinstance(call_id, str):
        raise invalid(f"{where}.id", "must be a string")
    return {"id": call_id, "name": fn["name"], "arguments": args}


def tool_call_out(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def tool_call_deltas_out(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed `delta.tool_calls` entries; consecutive pieces of one call are merged."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index and d.id is None:
            out[-1]["function"]["arguments"] += d.arguments
            continue
        entry: dict[str, Any] = {"index": d.index}
        fn: dict[str, Any] = {"arguments": d.arguments}
        if d.id is not None:
            entry["id"] = d.id
            entry["type"] = "function"
            fn = {"name": d.name, "arguments": d.arguments}
        entry["function"] = fn
        out.append(entry)
    return out


def tools_finish_reason(finish_reason: str | None, calls: Sequence[ToolCall]) -> str | None:
    """ "tool_calls" for a completion that ended by itself with calls (not one cut short)."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
