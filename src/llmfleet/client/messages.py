"""The public API's Python types and their protobuf messages, for both clients.

`build_request` turns keyword arguments into a `GenerateRequest` (type checks only: the router
validates values and names the field); `Accumulator` folds a `GenerateResponse` stream into
`Delta`s and a `GenerateResult` of `shared.core.outputs.Completion`s. No grpc, no torch.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.outputs import Completion, TokenLogprobs
from llmfleet.shared.wire.chat import chat_messages_to_pb, tools_to_pb
from llmfleet.shared.wire.convert import FINISH_FROM_PB, ROLE_FROM_PB, logprobs_from_pb
from llmfleet.v1 import common_pb2, generation_pb2


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted and verified
    num_accepted_tokens: int = 0  # and of those, accepted


@dataclass(frozen=True)
class Delta:
    """New output of completion `index`; `finish_reason` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_string: str = ""
    stop_token_id: int | None = None


@dataclass
class GenerateResult:
    request_id: str
    completions: list[Completion]
    usage: Usage | None = None


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    role: str  # "unified" | "prefill" | "decode"
    address: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_active_leases: int
    # KV blocks the router believes it holds; None while that view is stale.
    num_indexed_blocks: int | None = None


@dataclass(frozen=True)
class ServerInfo:
    version: str
    mode: str
    routing_policy: str
    workers: list[WorkerStatus]


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    token_ids: Sequence[int] | None = None,
    raw: bool = False,
    n: int | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
    structured_output: common_pb2.StructuredOutput | None = None,
    request_id: str | None = None,
    cache_salt: str = "",
    session_id: str = "",
    speculative: bool | None = None,
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; values are checked by the server.

    `messages` are {role, content} with, where set, `tool_calls` [{id, name, arguments}],
    `tool_call_id` and `name`; `tools` ({name, description, parameters}) go with them to the
    chat template (shared/wire/chat.py); `structured_output` constrains the output;
    `speculative` False keeps the worker from drafting tokens for it (None: its default)."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValidationError("prompt", "give exactly one of prompt, messages or token_ids")
    if isinstance(stop, str):
        raise ValidationError("stop", "must be a list of strings, not a single string")
    sampling = common_pb2.SamplingParams(
        stop=list(stop),
        stop_token_ids=_token_ids("stop_token_ids", stop_token_ids),
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    optional = {
        "n": n, "max_tokens": max_tokens, "min_tokens": min_tokens, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
        "seed": seed, "logprobs": logprobs, "skip_special_tokens": skip_special_tokens,
        "speculative": speculative,
    }  # fmt: skip
    for name, value in optional.items():
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (TypeError, ValueError) as exc:
                raise ValidationError(name, f"bad value {value!r}: {exc}") from None
    if structured_output is not None:
        sampling.structured_output.CopyFrom(structured_output)
    if tools and messages is None:
        raise ValidationError("tools", "tools are offered with chat messages only")
    req = generation_pb2.GenerateRequest(
        request_id=request_id or "",
        sampling=sampling,
        cache_salt=cache_salt,
        session_id=session_id,
    )
    if token_ids is not None:
        req.tokens.token_ids.extend(_token_ids("token_ids", token_ids))
    elif messages is not None:
        chat = common_pb2.ChatPrompt(
            messages=chat_messages_to_pb(messages), tools=tools_to_pb(tools)
        )
        if add_generation_prompt is not None:
            chat.add_generation_prompt = add_generation_prompt
        req.chat.CopyFrom(chat)
    elif not isinstance(prompt, str):
        raise ValidationError("prompt", "must be a string")
    elif raw:
        req.text = prompt
    else:
        req.chat.messages.append(common_pb2.ChatMessage(role="user", content=prompt))
    return req


def _token_ids(name: str, values: Sequence[int]) -> list[int]:
    """Integer token ids within int64 (the wire type); the server checks the vocabulary."""
    if isinstance(values, (str, bytes)):
        raise ValidationError(name, "must be a list of integers")
    out = []
    for i, t in enumerate(values):
        try:  # ints, numpy integers, 0-d integer tensors; not floats or strings
            if isinstance(t, bool):
                raise TypeError
            v = operator.index(t)
        except TypeError:
            raise ValidationError(f"{name}[{i}]", f"must be an integer, got {t!r}") from None
        if not -(2**63) <= v < 2**63:
            raise ValidationError(f"{name}[{i}]", f"{v} is out of range")
        out.append(v)
    return out


def num_completions(req: generation_pb2.GenerateRequest) -> int:
    """How many completions the response stream will carry (out-of-range n is the router's
    to reject)."""
    n = req.sampling.n if req.sampling.HasField("n") else 1
    return n if 1 <= n <= 1024 else 1


def _delta(pb: generation_pb2.CompletionDelta) -> Delta:
    return Delta(
        index=pb.index,
        text=pb.text,
        token_ids=list(pb.token_ids),
        finish_reason=FINISH_FROM_PB.get(pb.finish_reason),
        logprobs=[logprobs_from_pb(lp) for lp in pb.logprobs],
        stop_string=pb.stop_string,
        stop_token_id=pb.stop_token_id if pb.HasField("stop_token_id") else None,
    )


def _usage(pb: generation_pb2.GenerateResponse) -> Usage | None:
    if not pb.HasField("usage"):
        return None
    u = pb.usage
    return Usage(
        u.prompt_tokens,
        u.completion_tokens,
        u.cached_prompt_tokens,
        u.num_draft_tokens,
        u.num_accepted_tokens,
    )


class Accumulator:
    """Folds a response stream into a GenerateResult."""

    def __init__(self, n: int) -> None:
        self.result = GenerateResult("", [Completion(i) for i in range(n)])

    def add(self, pb: generation_pb2.GenerateResponse) -> list[Delta]:
        res = self.result
        res.request_id = pb.request_id or res.request_id
        deltas = [_delta(d) for d in pb.deltas]
        for d in deltas:
            while len(res.completions) <= d.index:
                res.completions.append(Completion(len(res.completions)))
            comp = res.completions[d.index]
            comp.text += d.text
            comp.token_ids.extend(d.token_ids)
            comp.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                comp.finish_reason = d.finish_reason
                comp.stop_string = d.stop_string
                comp.stop_token_id = d.stop_token_id
        usage = _usage(pb)
        if usage is not None:
            res.usage = usage
        return deltas


def server_info_from_pb(pb: generation_pb2.GetServerInfoResponse) -> ServerInfo:
    return ServerInfo(
        version=pb.version,
        mode=pb.mode,
        routing_policy=pb.routing_policy,
        workers=[
            WorkerStatus(
                worker_id=w.worker_id,
                role=ROLE_FROM_PB.get(w.role, "unspecified"),
                address=w.address,
                num_running=w.load.num_running,
                num_waiting=w.load.num_waiting,
                num_free_blocks=w.load.num_free_blocks,
                num_total_blocks=w.load.num_total_blocks,
                num_active_leases=w.load.num_active_leases,
                num_indexed_blocks=(
                    w.num_indexed_blocks if w.HasField("num_indexed_blocks") else None
                ),
            )
            for w in pb.workers
        ],
    )
