"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request is one Generate call (generation.py) of its chat messages (anthropic_convert.py);
`max_tokens` is required, as Anthropic's API has it. `tools` go to the chat template;
`tool_choice` {"type": "any"} or {"type": "tool"} is enforced by a grammar (tools.py) and the
output read back as `tool_use` blocks (`stop_reason` "tool_use"); "auto" parses the model's own
tool-call format. Every error, malformed bodies included, is in Anthropic's shape. Callers
authenticate with `x-api-key` (or a Bearer token) when the gateway has keys (auth.py).

A stream is Anthropic's event sequence: message_start, then per content block
content_block_start, (after the first) ping, content_block_delta (text_delta or
input_json_delta)..., content_block_stop; then message_delta (stop_reason, stop_sequence,
usage) and message_stop. An error after the stream started is one `error` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmfleet.client.messages import GenerateResult
from llmfleet.services.gateway import anthropic_convert as ac
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError, from_validation, invalid
from llmfleet.services.gateway.generation import run
from llmfleet.services.gateway.output_format import constrain
from llmfleet.services.gateway.streaming import Started
from llmfleet.services.gateway.tool_calls import ToolCallDelta, ToolUse
from llmfleet.services.gateway.upstream import ServedModel, Upstream
from llmfleet.shared.core.errors import ValidationError

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def install(app: FastAPI) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _anthropic_errors(_messages, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await _anthropic_errors(_count_tokens, request)


async def _anthropic_errors(
    handler: Callable[[Request], Awaitable[Response]], request: Request
) -> Response:
    try:
        return await handler(request)
    except APIError as exc:
        return ac.error_response(exc)


async def _body(request: Request, model: type[pydantic.BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(None, f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ac.body_error(exc.errors()) from None


def _prompt(
    body: ac.CountTokensRequest, served: ServedModel
) -> tuple[list[dict[str, Any]], ToolUse]:
    choice, parallel = ac.tool_choice(body)
    tools = ToolUse.of(ac.tools(body), choice, parallel, served, schema_field="input_schema")
    return ac.chat_messages(body), tools


async def _num_prompt_tokens(up: Upstream, messages: list[dict[str, Any]], tools: ToolUse) -> int:
    try:
        return await asyncio.to_thread(
            up.speller.chat_prompt_len, messages, **tools.render_kwargs()
        )
    except ValidationError as exc:
        raise from_validation(exc) from None


async def _count_tokens(request: Request) -> Response:
    body = await _body(request, ac.CountTokensRequest)
    up: Upstream = request.app.state.upstream
    served = await up.require(body.model)
    messages, tools = _prompt(body, served)
    return JSONResponse({"input_tokens": await _num_prompt_tokens(up, messages, tools)})


async def _messages(request: Request) -> Response:
    body: ac.MessagesRequest = await _body(request, ac.MessagesRequest)
    up: Upstream = request.app.state.upstream
    served = await up.require(body.model)
    messages, tools = _prompt(body, served)
    kwargs: dict[str, Any] = {
        "n": 1,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": list(body.stop_sequences or ()),
        "session_id": str((body.metadata or {}).get("user_id") or ""),
        "speculative": body.speculative,
        **tools.call_kwargs(),
    }
    params = {"stop": "stop_sequences", "chat.messages": "messages", **ac.part_origins(body)}
    constrain(kwargs, params, (body.output_config or {}).get("format"), "output_config.format")
    call = Call("chat", ac.new_message_id(), kwargs, body.stream, False, params)
    num_prompt = await _num_prompt_tokens(up, messages, tools) if body.stream else 0
    return await run(call, served, up, request, MessagesShape(call, served.name, tools, num_prompt))


def _event(kind: str, **fields: Any) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessagesShape:
    """One request's answer: the Message object, or its event stream."""

    def __init__(self, call: Call, model: str, tools: ToolUse, num_prompt_tokens: int) -> None:
        self.call = call
        self.model = model
        self.tools = tools
        self.num_prompt_tokens = num_prompt_tokens

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        [completion] = result.completions
        text, calls = self.tools.parse(completion.text)
        content: list[dict[str, Any]] = []
        if text or not calls:
            content.append({"type": "text", "text": text})
        content.extend(ac.tool_use_block(c) for c in calls)
        stop_string = completion.stop_string
        return ac.message(
            self.call.request_id,
            self.model,
            content,
            stop_reason=ac.stop_reason(completion.finish_reason, stop_string, calls),
            stop_sequence=stop_string or None,
            usage=ac.usage(result.usage),
        )

    async def events(self, started: Started) -> AsyncIterator[str]:
        opening = ac.message(
            self.call.request_id,
            self.model,
            [],
            stop_reason=None,
            stop_sequence=None,
            usage=ac.usage(None, self.num_prompt_tokens),
        )
        yield _event("message_start", message=opening)
        blocks = _Blocks()
        parser = self.tools.parser()
        finish_reason, stop_string = None, ""
        async for d in started.deltas():
            content, deltas = parser.feed(d.text) if parser else (d.text, [])
            for text in blocks.add(content, deltas):
                yield text
            if d.finish_reason is not None:
                finish_reason, stop_string = d.finish_reason, d.stop_string
        if parser is not None:
            for text in blocks.add(*parser.flush()):
                yield text
        for text in blocks.close(force_text=True):
            yield text
        calls = parser.finish() if parser is not None else []
        reason = ac.stop_reason(finish_reason, stop_string, calls)
        delta = {"stop_reason": reason, "stop_sequence": stop_string or None}
        usage = ac.usage(started.stream.usage, self.num_prompt_tokens)
        yield _event("message_delta", delta=delta, usage=usage)
        yield _event("message_stop")

    def error_event(self, error: APIError) -> str:
        return _event("error", error=ac.error_body(error)["error"])


class _Blocks:
    """Content blocks as they open, grow and close; one open at a time."""

    def __init__(self) -> None:
        self.index = -1  # of the open or last block
        self.open: str | None = None  # "text" | "tool_use"

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        out.append(_event("content_block_start", index=self.index, content_block=block))
        if self.index == 0:
            out.append(_event("ping"))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def add(self, content: str, deltas: list[ToolCallDelta]) -> list[str]:
        out: list[str] = []
        if content:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": content}))
        for d in deltas:
            if d.id is not None:
                block = {
                    "type": "tool_use",
                    "id": ac.tool_use_id(d.id),
                    "name": d.name,
                    "input": {},
                }
                out += self._start(block)
            if d.arguments and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return out

    def close(self, *, force_text: bool = False) -> list[str]:
        """Close the open block; `force_text`: an empty text block when there was none."""
        out: list[str] = []
        if force_text and self.index < 0:
            out += self._start({"type": "text", "text": ""})
        if self.open is not None:
            out.append(_event("content_block_stop", index=self.index))
            self.open = None
        return out
