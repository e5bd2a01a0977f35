"""Server-sent events of a streamed completion, and cancellation when the HTTP client leaves.

Stream shape (as OpenAI): chat first sends, per choice, a chunk whose delta is the assistant
role; then a chunk per new text of one choice (the choice's last one carries `finish_reason`);
with `stream_options.include_usage`, one more chunk with the usage and no choices; then
`data: [DONE]`. With tools, each choice's text goes through its tool-call parser (tools.py):
the delta carries the content it lets through and OpenAI's `tool_calls` entries (index, id,
type and function name first, then argument fragments); a choice that ended with calls
finishes with "tool_calls". An error after the stream started is sent as one
`data: {"error": ...}` event (HTTP status and headers are gone by then), followed by `[DONE]`.

Cancellation: `DisconnectWatch` waits on the ASGI receive channel for `http.disconnect` and then
cancels the Generate call, whose cancellation reaches the router, which drops the request in
the fleet and frees its KV blocks. It covers the whole request: the non-streaming wait, the wait
for a stream's first token (before any byte is sent), and the stream itself (where Starlette
also cancels the body iterator on disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from llmfleet.client.generation import AsyncGenerateStream
from llmfleet.client.messages import Delta, GenerateResult
from llmfleet.services.gateway import convert
from llmfleet.services.gateway.chat_tools import tool_call_deltas_out, tools_finish_reason
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.tokens import TokenSpeller
from llmfleet.services.gateway.tools import ToolCallParser

logger = logging.getLogger(__name__)


@dataclass
class Started:
    """A call whose first delta is in (None: it ended without output)."""

    call: Call
    stream: AsyncGenerateStream
    first: Delta | None
    rest: AsyncIterator[Delta]

    async def deltas(self) -> AsyncIterator[Delta]:
        if self.first is None:
            return
        yield self.first
        async for d in self.rest:
            yield d


DONE = "data: [DONE]\n\n"


class DisconnectWatch:
    """Calls `on_disconnect` once the HTTP client disconnects, until `close()`.

    Must be created inside the request's task (it starts a task of its own). Reading the
    receive channel concurrently with Starlette is safe: the server answers every waiter with
    `http.disconnect` once the connection is gone.
    """

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self.disconnected = False
        self._task = asyncio.create_task(self._watch(receive, on_disconnect))

    async def _watch(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        on_disconnect()

    def cancelled_us(self) -> bool:
        """True when a CancelledError just caught came from our cancel of the call, not from a
        cancellation of the current task (a server shutdown), which must propagate."""
        task = asyncio.current_task()
        return self.disconnected and (task is None or task.cancelling() == 0)

    def close(self) -> None:
        self._task.cancel()


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ChunkBuilder:
    """Turns deltas into chunk payloads; keeps each choice's text offset (completions)."""

    def __init__(self, call: Call, model: str, speller: TokenSpeller) -> None:
        self.call = call
        self.model = model
        self.speller = speller
        self._offsets = [0] * call.n
        self._parsers = [call.tool_parser() for _ in range(call.n)]

    def opening(self) -> list[dict[str, Any]]:
        if self.call.endpoint != "chat":
            return []
        return [
            convert.chunk(
                self.call,
                self.model,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(self.call.n)
        ]

    def delta(self, d: Delta) -> dict[str, Any] | None:
        """The chunk of one delta; None when it has nothing to show (text held back)."""
        parser = self._parsers[d.index] if d.index < len(self._parsers) else None
        if parser is not None:
            return self._tool_delta(d, parser)
        if not d.text and d.finish_reason is None and not (self.call.logprobs and d.logprobs):
            return None
        choice: dict[str, Any] = {"index": d.index}
        if self.call.endpoint == "chat":
            choice["delta"] = {"content": d.text} if d.text or d.finish_reason is None else {}
            lps = convert.chat_logprobs(d.logprobs, self.speller) if self.call.logprobs else None
        else:
            choice["text"] = d.text
            lps = None
            if self.call.logprobs:
                offset = self._offsets[d.index] if d.index < len(self._offsets) else 0
                lps = convert.completion_logprobs(d.logprobs, self.speller, offset)
                if d.index < len(self._offsets):
                    self._offsets[d.index] += sum(len(t) for t in lps["tokens"])
        choice["logprobs"] = lps
        choice["finish_reason"] = d.finish_reason
        return convert.chunk(self.call, self.model, [choice])

    def _tool_delta(self, d: Delta, parser: ToolCallParser) -> dict[str, Any] | None:
        content, calls = parser.feed(d.text)
        finish_reason = d.finish_reason
        if finish_reason is not None:
            more, more_calls = parser.flush()
            content, calls = content + more, calls + more_calls
            finish_reason = tools_finish_reason(finish_reason, parser.finish())
        lps = self.call.logprobs and d.logprobs
        if not content and not calls and finish_reason is None and not lps:
            return None
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = tool_call_deltas_out(calls)
        choice = {
            "index": d.index,
            "delta": delta,
            "logprobs": convert.chat_logprobs(d.logprobs, self.speller) if lps else None,
            "finish_reason": finish_reason,
        }
        return convert.chunk(self.call, self.model, [choice])

    def usage(self, stream: AsyncGenerateStream) -> dict[str, Any]:
        payload = convert.chunk(self.call, self.model, [])
        payload["usage"] = convert.usage(stream.usage)
        return payload


class ChunkShape:
    """OpenAI's chat and completions answers to one call (generation.py's `Shape`): the whole
    response object, or the chunk stream ending with `[DONE]`."""

    def __init__(self, call: Call, model: str, speller: TokenSpeller) -> None:
        self.builder = ChunkBuilder(call, model, speller)

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        b = self.builder
        return convert.response(b.call, b.model, result, b.speller)

    async def events(self, started: Started) -> AsyncIterator[str]:
        for payload in self.builder.opening():
            yield event(payload)
        async for d in started.deltas():
            payload = self.builder.delta(d)
            if payload is not None:
                yield event(payload)
        if self.builder.call.include_usage:
            yield event(self.builder.usage(started.stream))
        yield DONE

    def error_event(self, error: APIError) -> str:
        return event(error.body()) + DONE
