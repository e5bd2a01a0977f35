"""Function tools of the Responses and Anthropic Messages APIs, over tools.py.

Both APIs spell tools their own way ({name, description, parameters} flat; Anthropic's
`input_schema`) and their tool choice too; `ToolUse.of` takes them in the common form
({name, description, parameters}; tool_choice as Chat Completions spells it), validates them
with tools.py (an error names the field as the client's API spells it) and then gives what a
request needs: the Generate call's keywords (the tools for the chat template, the grammar of a
forced choice), the prompt-length keywords, and a fresh parser of the output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmfleet.services.gateway.errors import from_validation
from llmfleet.services.gateway.tool_parsers import ToolCall, ToolCallDelta, ToolCallParser
from llmfleet.services.gateway.tools import (
    FunctionTool,
    parse_tool_choice,
    parse_tools,
    tool_constraint,
    tool_stream,
)
from llmfleet.services.gateway.upstream import ServedModel
from llmfleet.shared.core.errors import ValidationError

__all__ = ["ToolCall", "ToolCallDelta", "ToolUse", "whole_calls"]


def whole_calls(calls: Sequence[ToolCall]) -> bool:
    """Whether the output made calls and every call's arguments are whole JSON: the answer is
    usable even when max_tokens ended it (a grammar may let the model pad a call with spaces)."""
    if not calls:
        return False
    try:
        for call in calls:
            json.loads(call.arguments)
    except json.JSONDecodeError:
        return False
    return True


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[FunctionTool, ...]
    choice: str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel: bool
    model_family: str

    @classmethod
    def of(
        cls,
        tools: Sequence[Mapping[str, Any]],
        choice: str | Mapping[str, Any] | None,
        parallel: bool,
        served: ServedModel,
        *,
        schema_field: str = "parameters",
    ) -> ToolUse:
        """Validated tools ({name, description, parameters}); `schema_field`: what the client's
        API calls `parameters`, for error messages."""
        if not tools and (choice is None or choice in ("auto", "none")):
            return cls((), "none", parallel, served.info.architecture)
        chat_form = [{"type": "function", "function": dict(t)} for t in tools]
        try:
            checked = parse_tools(chat_form)
            mode = parse_tool_choice(choice, checked)
        except ValidationError as exc:
            field = exc.field.replace(".function.", ".").replace(".parameters", f".{schema_field}")
            raise from_validation(ValidationError(field, exc.message)) from None
        if mode not in ("none", "auto", "required"):
            chosen: str | dict[str, Any] = {"type": "function", "function": {"name": mode}}
        else:
            chosen = mode
        return cls(tuple(checked), chosen, parallel, served.info.architecture)

    @property
    def active(self) -> bool:
        """Whether the output is read for calls."""
        return bool(self.tools) and self.choice != "none"

    def _tool_dicts(self) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "description": t.description, "parameters": t.parameters}
            for t in self.tools
        ]

    def call_kwargs(self) -> dict[str, Any]:
        """The Generate call's keywords: the tools, and the grammar a forced choice needs."""
        if not self.tools:
            return {}
        out: dict[str, Any] = {"tools": self._tool_dicts()}
        constraint = tool_constraint(list(self.tools), self.choice, self.parallel)
        if constraint is not None:
            out["structured_output"] = constraint
        return out

    def render_kwargs(self) -> dict[str, Any]:
        """`TokenSpeller.chat_prompt_len`'s keywords (the prompt renders the tools)."""
        return {"tools": self._tool_dicts()} if self.tools else {}

    def parser(self) -> ToolCallParser | None:
        """A parser of one completion's output; None: the output is all content."""
        if not self.active:
            return None
        return tool_stream(self.choice, self.parallel, self.model_family)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output as (content, calls)."""
        parser = self.parser()
        return (text, []) if parser is None else parser.parse(text)
