"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names, types and defaults follow OpenAI's Chat Completions and (legacy) Completions APIs,
plus the sampling extras vLLM accepts (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, ...) and vLLM's constraints (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, and their newer form `structured_outputs`). Only shapes and
types are checked here; value ranges are the router's to check (one source of truth:
`SamplingParams`), and its INVALID_ARGUMENT errors come back as 400s naming the OpenAI
parameter.

Unknown fields are ignored, as vLLM does: clients send vendor extras freely. Known OpenAI
features this server does not implement (logit_bias, echo, ...) are rejected by convert.py
with a 400 naming the field rather than silently ignored, because ignoring them would change
the meaning of the request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    """One part of a message's content given as a list of parts: "text" ({text}) or
    "image_url" ({image_url: {url, detail}} or the bare URL string)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(_Body):
    role: str
    # A string, a list of text and image parts, or null for an assistant turn that only
    # carried tool calls.
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls ([{id, type: "function", function: {name, arguments}}]) and a
    # tool message's answer to one.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # the session for routing, unless the X-Session-ID header names one
    logit_bias: dict[str, float] | None = None
    # vLLM extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Speculative decoding for this request: false never drafts; unset: the worker's default.
    # A JSON boolean only (not "true" or 1), as on the Responses and Messages endpoints.
    speculative: StrictBool | None = None
    # Output constraints (at most one): OpenAI's and vLLM's (guided.py).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM extra


class CompletionRequest(_Sampling):
    # Text, token ids, or a batch of one of those (OpenAI's four shapes).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


Endpoint = Literal["chat", "completions"]
