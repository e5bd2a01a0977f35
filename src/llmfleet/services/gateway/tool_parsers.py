"""Tool calls in a model's free text (tool_choice "auto"): one parser per output format.

    parser = tool_parser_for("hermes")
    content, deltas = parser.feed(text_delta)   # streaming, any split of the text
    calls = parser.finish()                     # every call of the completion
    content, calls = parser.parse(whole_text)   # non-streaming

The Hermes format (Hermes 2 Pro, Qwen2.5/3, and the system-prompt fallback of text/tools.py)
writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text outside
the tags is the message's content. A block whose JSON does not parse as a call is kept as
content: the client then sees what the model wrote rather than losing it.

Streaming invariants: content is never shown before it is known not to start a `<tool_call>`
tag (a possible tag prefix at the end is held back); a call is announced once its block has
closed, as two deltas (id and name with empty arguments, then the arguments), so that its
arguments are whole JSON once concatenated. A parser is per completion and not thread-safe.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: the first carries `id` and `name`, later ones only
    fragments of `arguments` (which concatenate to the call's arguments)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """The deltas announcing a whole call: its id and name, then its arguments."""
    return [
        ToolCallDelta(index, id=call.id, name=call.name),
        ToolCallDelta(index, arguments=call.arguments),
    ]


class ToolCallParser(Protocol):
    """Per completion: `feed` the text deltas, then `flush` once at its end (the held-back
    text and a block left open), then `finish` for the calls; or `parse` a whole text."""

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]: ...

    def flush(self) -> tuple[str, list[ToolCallDelta]]: ...

    def finish(self) -> list[ToolCall]: ...

    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...


def call_from_json(text: str) -> ToolCall | None:
    """A call from `{"name": str, "arguments": object}` (or "parameters", as some models write);
    None when `text` is not that."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """`<tool_call>{json}</tool_call>` blocks; see the module docstring."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls=false: 1 (later blocks are dropped)
        self._buf = ""  # text not yet resolved: a possible tag prefix, or an open block
        self._in_call = False
        self._calls: list[ToolCall] = []
        self._content_out = False  # some content has been shown

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(self.OPEN) :]
                self._in_call = True
            else:
                at = self._buf.find(self.CLOSE)
                if at < 0:
                    break
                body, self._buf = self._buf[:at], self._buf[at + len(self.CLOSE) :]
                self._in_call = False
                call = call_from_json(body.strip())
                if call is None:
                    content.append(f"{self.OPEN}{body}{self.CLOSE}")
                elif self.max_calls is None or len(self._calls) < self.max_calls:
                    deltas.extend(call_deltas(len(self._calls), call))
                    self._calls.append(call)
        return self._shown("".join(content)), deltas

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the text: a block the model never closed is parsed if it is a whole
        call (models often stop at EOS right after the JSON), else shown as text."""
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return self._shown(rest), []
        self._in_call = False
        call = call_from_json(rest.strip())
        if call is None:
            return self._shown(self.OPEN + rest), []
        if self.max_calls is not None and len(self._calls) >= self.max_calls:
            return "", []
        self._calls.append(call)
        return "", call_deltas(len(self._calls) - 1, call)

    def finish(self) -> list[ToolCall]:
        return list(self._calls)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        content, _ = self.feed(text)
        rest, _ = self.flush()
        content += rest
        # Whitespace between and around blocks is layout, not content.
        return (content.strip() if self._calls else content), self.finish()

    def _shown(self, text: str) -> str:
        if not self._content_out:
            if self._calls or self._in_call:  # text after a call: layout whitespace dropped
                text = text.lstrip()
            if text:
                self._content_out = True
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_PARSERS: dict[str, Callable[[int | None], ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
}
DEFAULT_PARSER = "hermes"


def tool_parser_for(model_family: str, max_calls: int | None = None) -> ToolCallParser:
    """A new parser for a model family's tool-call format; families without a registered
    format use the Hermes one (the format of the system-prompt fallback, text/tools.py)."""
    factory = _PARSERS.get(model_family.lower(), _PARSERS[DEFAULT_PARSER])
    return factory(max_calls)
