"""OpenAI requests to Generate calls, and Generate results to OpenAI response objects.

Pure functions over the pydantic bodies (protocol.py) and the client library's result types
(`llmfleet.client.generation`); nothing here does I/O. A request becomes a `Call`: the keyword
arguments of `build_request` plus what shaping the answer needs. A response is built as the
plain dict OpenAI documents (ids, `object`, `created`, `model`, `choices`, `usage`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmfleet.client.messages import GenerateResult, Usage
from llmfleet.services.gateway import guided
from llmfleet.services.gateway.chat_tools import call_in, tool_call_out, tools_finish_reason
from llmfleet.services.gateway.content import openai_content
from llmfleet.services.gateway.errors import from_validation, invalid
from llmfleet.services.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Endpoint,
)
from llmfleet.services.gateway.tokens import TokenSpeller
from llmfleet.services.gateway.tools import (
    ToolCallParser,
    parse_tool_choice,
    parse_tools,
    tool_constraint,
    tool_stream,
)
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.outputs import Completion, TokenLogprobs

_INT64_MAX = (1 << 63) - 1
# The tool-call format read from "auto" output (tool_parsers.py's registry).
TOOL_CALL_PARSER = "hermes"


@dataclass
class Call:
    """One Generate call made from an OpenAI request."""

    endpoint: Endpoint
    request_id: str  # also the response's `id`
    kwargs: dict[str, Any]  # `build_request` keywords: the prompt and sampling
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage and no choices
    # Sampling field -> the OpenAI parameter this request set it with, for error messages.
    params: dict[str, str] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    # Chat with tools: "none" | "auto" | "required" | {"type": "function", "function": {name}}.
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True

    def tool_parser(self) -> ToolCallParser | None:
        """A new parser of one completion's tool calls; None when output is text only."""
        if self.endpoint != "chat" or self.tool_choice == "none":
            return None
        return tool_stream(self.tool_choice, self.parallel_tool_calls, TOOL_CALL_PARSER)

    @property
    def n(self) -> int:
        return self.kwargs["n"]

    @property
    def logprobs(self) -> bool:
        """Whether to answer with logprobs (the call asks for them)."""
        return "logprobs" in self.kwargs


def _call(
    endpoint: Endpoint,
    id_prefix: str,
    req: ChatCompletionRequest | CompletionRequest,
    kwargs: dict[str, Any],
    params: dict[str, str] | None = None,
) -> Call:
    return Call(
        endpoint=endpoint,
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        kwargs=kwargs,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        params=params or {},
    )


# ---- requests -----------------------------------------------------------------------------


def _common(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    if req.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    return {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or ()),
        "stop_token_ids": list(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "speculative": req.speculative,
        "session_id": req.user or "",
    }


def _constrained(
    req: ChatCompletionRequest | CompletionRequest,
    kwargs: dict[str, Any],
    params: dict[str, str],
    tool_so: Any = None,
    tool_param: str = "tool_choice",
) -> None:
    """Sets kwargs["structured_output"] from the body's constraint or the tools' (not both)."""
    try:
        so, param = guided.structured_output(req)
    except ValidationError as exc:
        raise from_validation(exc) from None
    if so is not None and tool_so is not None:
        forced = getattr(req, "tool_choice", None)
        raise invalid(param, f"{param} cannot be combined with tool_choice {forced!r}")
    if tool_so is not None:
        so, param = tool_so, tool_param
    if so is not None and param is not None:
        kwargs["structured_output"] = so
        params.update(guided.error_params(param))


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as {role, content} ("developer" read as "system"; text parts joined, parts
    kept as a list when there are images), with an assistant turn's `tool_calls` [{id, name,
    arguments}] and a tool's `tool_call_id`."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": openai_content(m, i)}
        if m.tool_calls:
            if m.role != "assistant":
                raise invalid(f"messages[{i}].tool_calls", "only assistant messages have them")
            where = f"messages[{i}].tool_calls"
            msg["tool_calls"] = [call_in(c, f"{where}[{j}]") for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid(f"messages[{i}].tool_call_id", "a tool message must name its call")
            msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


def chat_call(req: ChatCompletionRequest) -> Call:
    """The Generate call of a chat request; `kwargs["max_tokens"]` is None when the client left
    it to the context length (the caller fills it in from the prompt's length)."""
    if req.top_logprobs and not req.logprobs:  # top_logprobs=0 alone asks for nothing
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    kwargs = _common(req)
    params = {}
    kwargs["max_tokens"] = req.max_tokens
    if req.max_completion_tokens is not None:
        kwargs["max_tokens"] = req.max_completion_tokens
        params["max_tokens"] = "max_completion_tokens"
    if req.logprobs:
        kwargs["logprobs"] = req.top_logprobs or 0
        params["logprobs"] = "top_logprobs" if req.top_logprobs is not None else "logprobs"
    kwargs["messages"] = chat_messages(req.messages)
    kwargs["add_generation_prompt"] = req.add_generation_prompt
    try:
        tools = parse_tools(req.tools or [])
        choice = parse_tool_choice(req.tool_choice, tools)
    except ValidationError as exc:
        raise from_validation(exc) from None
    # With tool_choice "none" the tools are still rendered (see tools.py), never parsed.
    kwargs["tools"] = [
        {"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools
    ]
    if choice not in ("none", "auto", "required"):
        choice_form: str | dict[str, Any] = {"type": "function", "function": {"name": choice}}
    else:
        choice_form = choice
    tool_so = tool_constraint(tools, choice_form, req.parallel_tool_calls) if tools else None
    _constrained(req, kwargs, params, tool_so, "tools")
    call = _call("chat", "chatcmpl", req, kwargs, params)
    call.tool_choice = choice_form
    call.parallel_tool_calls = req.parallel_tool_calls
    return call


def _prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt, "raw": True}
    if prompt and not isinstance(prompt[0], int):  # a batch
        if len(prompt) != 1:
            raise invalid("prompt", "batched prompts are not supported: send one per request")
        return _prompt(prompt[0])
    ids: list[int] = prompt  # type: ignore[assignment]
    for i, t in enumerate(ids):
        if not 0 <= t <= _INT64_MAX:
            raise invalid("prompt", f"token id {t} at position {i} is out of range")
    return {"token_ids": ids}


def completion_call(req: CompletionRequest) -> Call:
    if req.echo:
        raise invalid("echo", "echo is not supported")
    if req.suffix:
        raise invalid("suffix", "suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of", "best_of other than n is not supported")
    kwargs = {**_common(req), **_prompt(req.prompt)}
    params: dict[str, str] = {}
    _constrained(req, kwargs, params)
    if req.max_tokens is not None:
        kwargs["max_tokens"] = req.max_tokens  # else the server's default (16, as OpenAI's)
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    return _call("completions", "cmpl", req, kwargs, params)


def default_max_tokens(num_prompt_tokens: int, max_model_len: int) -> int:
    """OpenAI chat's default: whatever the context leaves after the prompt."""
    if num_prompt_tokens >= max_model_len:
        raise invalid(
            "messages",
            f"the prompt has {num_prompt_tokens} tokens; the context length is {max_model_len}",
        )
    return max_model_len - num_prompt_tokens


# ---- responses ----------------------------------------------------------------------------


def usage(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }
    if u.num_draft_tokens:  # speculative decoding ran for it (docs/fleet.md)
        out["completion_tokens_details"] = {
            "num_draft_tokens": u.num_draft_tokens,
            "num_accepted_tokens": u.num_accepted_tokens,
        }
    return out


def chat_logprobs(lps: Sequence[TokenLogprobs], speller: TokenSpeller) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = speller.spell(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        {
            **entry(lp.token_id, lp.logprob),
            "top_logprobs": [
                entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            ],
        }
        for lp in lps
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    lps: Sequence[TokenLogprobs], speller: TokenSpeller, text_offset: int = 0
) -> dict[str, Any]:
    """Legacy logprobs; `text_offset` is where these tokens start in the choice's text."""
    tokens, offsets, top = [], [], []
    for lp in lps:
        text = speller.text(lp.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        alternatives = {
            speller.text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        }
        # The sampled token is always listed, with its own logprob even when another token of
        # the top ones is spelled the same (e.g. two partial characters, both U+FFFD).
        alternatives[text] = lp.logprob
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_choice(c: Completion, call: Call, speller: TokenSpeller) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish_reason = c.finish_reason
    parser = call.tool_parser()
    if parser is not None:
        content, calls = parser.parse(c.text)
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [tool_call_out(tc) for tc in calls]
        finish_reason = tools_finish_reason(finish_reason, calls)
    return {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(c.logprobs, speller) if call.logprobs else None,
        "finish_reason": finish_reason,
    }


def _completion_choice(c: Completion, call: Call, speller: TokenSpeller) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": completion_logprobs(c.logprobs, speller) if call.logprobs else None,
        "finish_reason": c.finish_reason,
    }


def response(
    call: Call, model: str, result: GenerateResult, speller: TokenSpeller
) -> dict[str, Any]:
    """The whole (non-streaming) answer."""
    choice = _chat_choice if call.endpoint == "chat" else _completion_choice
    return {
        "id": call.request_id,
        "object": "chat.completion" if call.endpoint == "chat" else "text_completion",
        "created": call.created,
        "model": model,
        "choices": [choice(c, call, speller) for c in result.completions],
        "usage": usage(result.usage),
    }


def chunk(call: Call, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed chunk; with include_usage every chunk carries `usage: null` but the last."""
    out: dict[str, Any] = {
        "id": call.request_id,
        "object": "chat.completion.chunk" if call.endpoint == "chat" else "text_completion",
        "created": call.created,
        "model": model,
        "choices": choices,
    }
    if call.include_usage:
        out["usage"] = None
    return out
