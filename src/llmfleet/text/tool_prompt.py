"""Tools and tool turns of a chat, shaped for the model's chat template.

A template that reads the `tools` variable gets the tools as Hugging Face passes them
(`[{"type": "function", "function": {name, description, parameters}}]`); assistant turns'
`tool_calls` and `tool` messages go to it as they are when it knows them (it mentions
`tool_calls` / the "tool" role). For a template that does not, the conversation is rewritten in
the Hermes format (Hermes 2 Pro, Qwen2.5), which the default tool-call parser reads back:

    system:    <its text>\\n\\n# Tools ... <tools>{one tool as JSON per line}</tools> ...
    assistant: <its text>\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    user:      <tool_response>\\n<the tool's output>\\n</tool_response>  (consecutive tool
               messages share one user turn; only in a conversation with tools or calls)
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_TOOL_ROLE = re.compile(r"""['"]tool['"]""")


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders natively."""

    tools: bool  # reads the `tools` variable
    tool_calls: bool  # renders assistant turns' `tool_calls`
    tool_role: bool  # renders `tool` messages as such


@functools.lru_cache(maxsize=16)
def template_support(template: str) -> TemplateSupport:
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        names = set()
    return TemplateSupport(
        tools="tools" in names,
        tool_calls="tool_calls" in template,
        tool_role=_TOOL_ROLE.search(template) is not None,
    )


def hf_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tools ({name, description, parameters}) in the shape chat templates read."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def hermes_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [json.dumps(t, ensure_ascii=False) for t in hf_tools(tools)]
    return "\n".join([_TOOLS_HEADER, *lines, _TOOLS_FOOTER])


def _arguments(text: str) -> Any:
    """Arguments as templates expect them: an object (JSON text that is not one stays text)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def _hermes_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(
        "<tool_call>\n"
        + json.dumps(
            {"name": c["name"], "arguments": _arguments(c.get("arguments", "{}"))},
            ensure_ascii=False,
        )
        + "\n</tool_call>"
        for c in calls
    )


def shape_for_template(
    support: TemplateSupport,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to pass to the template: see the module docstring. The tools are None
    when there are none or when they went into the system message instead."""
    out: list[dict[str, Any]] = []
    # Tool messages are rewritten only in a conversation with tools (a template that renders
    # any role keeps rendering a lone "tool" message as it always did).
    tooled = bool(tools) or any(m.get("tool_calls") for m in messages)
    for m in messages:
        role, content = m["role"], m.get("content", "")
        calls = m.get("tool_calls") or ()
        if role == "assistant" and calls:
            if support.tool_calls:
                out.append(
                    {
                        "role": role,
                        "content": content,
                        "tool_calls": [
                            {
                                "id": c.get("id", ""),
                                "type": "function",
                                "function": {
                                    "name": c["name"],
                                    "arguments": _arguments(c.get("arguments", "{}")),
                                },
                            }
                            for c in calls
                        ],
                    }
                )
            else:
                text = _hermes_calls(calls)
                out.append({"role": role, "content": f"{content}\n{text}" if content else text})
        elif role == "tool" and tooled and not support.tool_role:
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        elif role == "tool":
            shaped = {"role": role, "content": content}
            for key in ("tool_call_id", "name"):
                if m.get(key):
                    shaped[key] = m[key]
            out.append(shaped)
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_responses", None)
    if not tools:
        return out, None
    if support.tools:
        return out, hf_tools(tools)
    block = hermes_tools_block(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None
