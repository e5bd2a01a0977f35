"""Function tools of a chat request: their validation, the grammar that enforces a tool_choice,
and the calls read back from the output. Pure Python: no FastAPI, no I/O.

tool_choice (as OpenAI): "none" (tools are rendered in the prompt, as vLLM does, so that the
conversation's prefix stays cacheable across turns, but the output is never parsed for calls),
"auto" (the model decides; its free text is parsed by the model family's parser,
tool_parsers.py), "required" (at least one call) and a named function (exactly that call). The
last two are enforced with a JSON-schema constraint (`tool_constraint`), so the output always
parses into calls whose arguments validate against their schema:

    required:  [{"name": "<one of the tools>", "parameters": {...its arguments...}}, ...]
    named:     {...the function's arguments...}

(the same shapes as vLLM's). `parallel_tool_calls=false` caps "required" at one call (maxItems 1)
and keeps only the first call "auto" produces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from llmfleet.services.gateway.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    call_deltas,
    new_call_id,
    tool_parser_for,
)
from llmfleet.shared.core.errors import ValidationError
from llmfleet.v1 import common_pb2

__all__ = [
    "FunctionTool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "parse_constrained",
    "parse_tool_choice",
    "parse_tools",
    "tool_constraint",
    "tool_parser_for",
    "tool_stream",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict  # a JSON Schema of the arguments object


def parse_tools(raw: Sequence[Any]) -> list[FunctionTool]:
    """OpenAI `tools` ([{"type": "function", "function": {name, description, parameters}}]);
    a ValidationError names the first bad field (`tools[1].function.parameters`)."""
    tools: list[FunctionTool] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping):
            raise ValidationError(where, "must be an object")
        if t.get("type") != "function":
            raise ValidationError(f"{where}.type", f"must be 'function', got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ValidationError(f"{where}.function", "must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError(
                f"{where}.function.name",
                f"must be 1-64 letters, digits, underscores or dashes, got {name!r}",
            )
        if any(tool.name == name for tool in tools):
            raise ValidationError(f"{where}.function.name", f"duplicate function name {name!r}")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValidationError(f"{where}.function.description", "must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = dict(_NO_PARAMETERS)
        if not isinstance(parameters, Mapping):
            raise ValidationError(f"{where}.function.parameters", "must be a JSON Schema object")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise ValidationError(
                f"{where}.function.parameters", f"not a valid JSON Schema: {exc.message}"
            ) from None
        tools.append(FunctionTool(name, description, dict(parameters)))
    return tools


def parse_tool_choice(choice: str | Mapping[str, Any] | None, tools: Sequence[FunctionTool]) -> str:
    """ "none", "auto", "required" or the name of the function chosen. Unset: "auto" with tools,
    "none" without (as OpenAI)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValidationError(
                "tool_choice", f"must be 'none', 'auto', 'required' or a function, got {choice!r}"
            )
        if choice != "none" and not tools:
            raise ValidationError("tool_choice", f"{choice!r} requires tools")
        return choice
    name = _chosen_name(choice)
    if name is None:
        raise ValidationError(
            "tool_choice", 'must be {"type": "function", "function": {"name": ...}}'
        )
    if not any(t.name == name for t in tools):
        raise ValidationError("tool_choice", f"names {name!r}, which is not one of the tools")
    return name


def _chosen_name(choice: Mapping[str, Any]) -> str | None:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    return name if isinstance(name, str) and name else None


def _mode(choice: str | Mapping[str, Any]) -> str:
    """ "none" | "auto" | "required" | a function's name, from either form of tool_choice."""
    if isinstance(choice, str):
        return choice
    name = _chosen_name(choice)
    if name is None:
        raise ValidationError("tool_choice", "names no function")
    return name


def tool_constraint(
    tools: list[FunctionTool], choice: str | dict, parallel: bool
) -> common_pb2.StructuredOutput | None:
    """The constraint enforcing `choice` (None for "auto" and "none"); see the module docstring
    for the shapes, which `parse_constrained` reads back."""
    mode = _mode(choice)
    if mode in ("auto", "none"):
        return None
    if mode == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": t.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": items[0] if len(items) == 1 else {"anyOf": items},
        }
        if not parallel:
            schema["maxItems"] = 1
    else:
        schema = _tool(tools, mode).parameters
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema))


def _tool(tools: Sequence[FunctionTool], name: str) -> FunctionTool:
    for t in tools:
        if t.name == name:
            return t
    raise ValidationError("tool_choice", f"names {name!r}, which is not one of the tools")


def parse_constrained(text: str, choice: str | dict) -> list[ToolCall]:
    """The calls in output generated under `tool_constraint(tools, choice, ...)`. Output cut
    short (max_tokens) keeps what is whole: a named call keeps its text as arguments, a
    "required" array the calls that closed."""
    stream = ConstrainedToolStream(choice)
    stream.feed(text)
    stream.flush()
    return stream.finish()


class ConstrainedToolStream:
    """A ToolCallParser for output under a tool constraint: the text is never content.

    Named: the call is announced on the first text, whose deltas are then its arguments.
    Required: each element of the array is announced once its object closes (a bracket scan
    that skips strings), so a stream shows every call as soon as it is whole.
    """

    def __init__(self, choice: str | Mapping[str, Any]) -> None:
        self._mode = _mode(choice)
        if self._mode in ("auto", "none"):
            raise ValueError(f"tool_choice {self._mode!r} is not enforced by a constraint")
        self._calls: list[ToolCall] = []
        self._named_id = new_call_id()
        self._named_args: list[str] = []
        # "required": the array's text and the scan's state.
        self._buf = ""
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._start = -1  # where the element being scanned starts

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if not delta:
            return "", []
        if self._mode != "required":
            out = []
            if not self._named_args:
                out.append(ToolCallDelta(0, id=self._named_id, name=self._mode))
            self._named_args.append(delta)
            out.append(ToolCallDelta(0, arguments=delta))
            return "", out
        self._buf += delta
        out = []
        for call in self._scan():
            out.extend(call_deltas(len(self._calls), call))
            self._calls.append(call)
        return "", out

    def _scan(self) -> list[ToolCall]:
        found = []
        buf = self._buf
        for i in range(self._pos, len(buf)):
            c = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2 and c == "{":
                    self._start = i
            elif c in "]}":
                self._depth -= 1
                if self._depth == 1 and self._start >= 0:
                    call = _element_call(buf[self._start : i + 1])
                    if call is not None:
                        found.append(call)
                    self._start = -1
        self._pos = len(buf)
        return found

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    def finish(self) -> list[ToolCall]:
        if self._mode == "required":
            return list(self._calls)
        if not self._named_args:
            return []
        return [ToolCall(self._named_id, self._mode, "".join(self._named_args))]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        self.feed(text)
        return "", self.finish()


def _element_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", {})
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def tool_stream(
    choice: str | Mapping[str, Any], parallel: bool, model_family: str
) -> ToolCallParser | None:
    """The parser of one completion's output under `choice`: None for "none" (text only)."""
    mode = _mode(choice)
    if mode == "none":
        return None
    if mode == "auto":
        return tool_parser_for(model_family, max_calls=None if parallel else 1)
    return ConstrainedToolStream(choice)
