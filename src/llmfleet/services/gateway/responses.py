"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is one Generate call of its conversation (generation.py): the stored conversation
of `previous_response_id` (an unknown id is a 404), then `input`, behind `instructions`.
Function `tools` go to the chat template; `tool_choice` "required" or a named function is
enforced by a grammar (tools.py) and the output read back as `function_call` items, "auto"
parses the model's own tool-call format; `text.format` constrains the text (output_format.py).
With `store` (the default) the answer is kept in the gateway's ResponseStore for GET and
continuation.

A stream is OpenAI's event sequence, each event `event: <type>` + `data: {..., "sequence_number"}`:
response.created, response.in_progress, then per output item response.output_item.added,
(a message) response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, (a function call) response.function_call_arguments.delta...,
response.function_call_arguments.done, then response.output_item.done; last
response.completed (response.incomplete when `max_output_tokens` cut it short). An error after
the stream started is one `error` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmfleet.client.messages import GenerateResult, Usage
from llmfleet.services.gateway import responses_convert as rc
from llmfleet.services.gateway import tool_calls
from llmfleet.services.gateway.convert import Call
from llmfleet.services.gateway.errors import APIError
from llmfleet.services.gateway.generation import context_left, run
from llmfleet.services.gateway.output_format import constrain
from llmfleet.services.gateway.responses_convert import ResponsesRequest
from llmfleet.services.gateway.responses_store import ResponseStore
from llmfleet.services.gateway.streaming import Started
from llmfleet.services.gateway.upstream import ServedModel, Upstream
from llmfleet.shared.core.config import GatewayConfig

ROUTES = ("/v1/responses",)


def install(app: FastAPI, config: GatewayConfig) -> None:
    """Add the routes, with a store bounded as `config` says."""
    store = ResponseStore(
        max_entries=config.responses_store_max_entries,
        max_bytes=config.responses_store_max_bytes,
        ttl_s=config.responses_store_ttl_s,
    )
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        prefix: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise rc.not_found(body.previous_response_id, "previous_response_id")
            prefix = previous.conversation
        conversation = [*prefix, *rc.input_messages(body.input)]
        call, tools = _call(body, served, conversation)
        if call.kwargs["max_tokens"] is None:
            call.kwargs["max_tokens"] = await context_left(
                up, served, call.kwargs["messages"], **tools.render_kwargs()
            )
        shape = ResponsesShape(body, call, served.name, conversation, tools, store)
        return await run(call, served, up, request, shape)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        entry = store.get(response_id)
        if entry is None:
            raise rc.not_found(response_id)
        return JSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise rc.not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _call(
    body: ResponsesRequest, served: ServedModel, conversation: list[dict[str, Any]]
) -> tuple[Call, tool_calls.ToolUse]:
    tools = tool_calls.ToolUse.of(
        rc.function_tools(body), rc.tool_choice(body), body.parallel_tool_calls, served
    )
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    kwargs: dict[str, Any] = {
        "n": 1,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "speculative": body.speculative,
        "session_id": body.user or "",
        **tools.call_kwargs(),
    }
    params = {"max_tokens": "max_output_tokens", "chat.messages": "input"}
    constrain(kwargs, params, (body.text or {}).get("format"), "text.format")
    call = Call("chat", rc.new_id("resp"), kwargs, body.stream, False, params)
    return call, tools


def _event(kind: str, seq: int, **fields: Any) -> str:
    payload = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponsesShape:
    """One request's answer: the Response object, or its event stream; stores it when asked."""

    def __init__(
        self,
        req: ResponsesRequest,
        call: Call,
        model: str,
        conversation: list[dict[str, Any]],
        tools: tool_calls.ToolUse,
        store: ResponseStore,
    ) -> None:
        self.req = req
        self.call = call
        self.model = model
        self.conversation = conversation
        self.tools = tools
        self.store = store
        self.created_at = int(time.time())
        self._seq = 0

    def _response(
        self,
        output: list[dict[str, Any]],
        ended: tuple[str, dict[str, Any] | None],
        usage: Usage | None,
    ) -> dict[str, Any]:
        status, details = ended
        response = rc.response_object(
            self.req,
            self.call.request_id,
            self.model,
            created_at=self.created_at,
            status=status,
            output=output,
            incomplete_details=details,
            usage=rc.usage(usage),
        )
        if self.req.store:
            conversation = [*self.conversation, *rc.output_messages(output)]
            self.store.put(self.call.request_id, response, conversation)
        return response

    def whole(self, result: GenerateResult) -> dict[str, Any]:
        [completion] = result.completions
        content, calls = self.tools.parse(completion.text)
        ended = rc.status_of(completion.finish_reason, calls)
        status = ended[0]
        output = []
        if content or not calls:
            output.append(rc.message_item(rc.new_id("msg"), content, status))
        for call in calls:
            output.append(
                rc.function_call_item(rc.new_id("fc"), call.id, call.name, call.arguments, status)
            )
        return self._response(output, ended, result.usage)

    def _next(self, kind: str, **fields: Any) -> str:
        text = _event(kind, self._seq, **fields)
        self._seq += 1
        return text

    async def events(self, started: Started) -> AsyncIterator[str]:
        opening = rc.response_object(
            self.req,
            self.call.request_id,
            self.model,
            created_at=self.created_at,
            status="in_progress",
            output=[],
        )
        yield self._next("response.created", response=opening)
        yield self._next("response.in_progress", response=opening)
        items = _StreamedItems(self._next)
        parser = self.tools.parser()
        finish_reason = None
        async for d in started.deltas():
            content, deltas = parser.feed(d.text) if parser else (d.text, [])
            for text in items.add(content, deltas):
                yield text
            finish_reason = d.finish_reason or finish_reason
        if parser is not None:
            for text in items.add(*parser.flush()):
                yield text
        ended = rc.status_of(finish_reason, parser.finish() if parser is not None else [])
        for text in items.close(ended[0], force_message=True):
            yield text
        response = self._response(items.output, ended, started.stream.usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield self._next(kind, response=response)

    def error_event(self, error: APIError) -> str:
        return self._next("error", code=error.code, message=error.message, param=error.param)


class _StreamedItems:
    """The output items of a stream as they open, grow and close: at most one open at a time
    (text after a call opens a new message item)."""

    def __init__(self, next_event: Callable[..., str]) -> None:
        self._next = next_event
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []

    def add(self, content: str, deltas: list[tool_calls.ToolCallDelta]) -> list[str]:
        out: list[str] = []
        if content:
            if self._open is None or self._open["type"] != "message":
                out += self.close("completed")
                out += self._open_message()
            self._text.append(content)
            out.append(
                self._next(
                    "response.output_text.delta",
                    **self._where(),
                    delta=content,
                    content_index=0,
                    logprobs=[],
                )
            )
        for d in deltas:
            if d.id is not None:
                out += self.close("completed")
                item = rc.function_call_item(rc.new_id("fc"), d.id, d.name or "", "", "in_progress")
                out += self._open_item(item)
            if d.arguments and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += d.arguments
                out.append(
                    self._next(
                        "response.function_call_arguments.delta", **self._where(), delta=d.arguments
                    )
                )
        return out

    def _where(self) -> dict[str, Any]:
        """Where the open item (always the last of `output`) is, as events name it."""
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open_item(self, item: dict[str, Any]) -> list[str]:
        self._open = item
        self.output.append(item)
        return [
            self._next(
                "response.output_item.added",
                output_index=len(self.output) - 1,
                item=item,
            )
        ]

    def _open_message(self) -> list[str]:
        out = self._open_item(rc.message_item(rc.new_id("msg"), None, "in_progress"))
        self._text = []
        out.append(
            self._next(
                "response.content_part.added",
                **self._where(),
                content_index=0,
                part=rc.text_part(""),
            )
        )
        return out

    def close(self, status: str, *, force_message: bool = False) -> list[str]:
        """Close the open item; `force_message`: an empty message when no item was opened."""
        out: list[str] = []
        if self._open is None and force_message and not self.output:
            out += self._open_message()
        item = self._open
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            text = "".join(self._text)
            out.append(
                self._next(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            item["content"] = [rc.text_part(text)]
            out.append(
                self._next(
                    "response.content_part.done", **where, content_index=0, part=item["content"][0]
                )
            )
        else:
            out.append(
                self._next(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = status
        out.append(
            self._next("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self._open = None
        return out
