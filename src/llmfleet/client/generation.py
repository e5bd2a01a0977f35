"""Client library for the public API (`llmfleet.v1.Generation`, served by the router).

    with GenerationClient("127.0.0.1:50051") as client:
        res = client.generate("What is the capital of France?", max_tokens=32, temperature=0)
        print(res.completions[0].text, res.usage)
        for delta in client.stream("Tell me a story.", max_tokens=64):
            print(delta.text, end="", flush=True)

    async with AsyncGenerationClient("127.0.0.1:50051") as client:
        res = await client.generate(messages=[{"role": "user", "content": "Hi"}])
        async for delta in client.stream(token_ids=[1, 2, 3], raw=True):
            ...

A plain `str` prompt is sent as one user chat message (the model's chat template applies) unless
`raw=True`, which sends it as text to be completed as is. Sampling arguments left as None take
the server's defaults (see `SamplingParams` in common.proto). Every gRPC failure surfaces as
`ClientError(code_name, message)` carrying the server's message.

This module imports only grpc and the generated messages (no torch), so the CLI starts fast.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import common_pb2, generation_pb2, generation_pb2_grpc

DEFAULT_ENDPOINT = "127.0.0.1:50051"

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
_ROLES = {
    common_pb2.WORKER_ROLE_UNIFIED: "unified",
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
}
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class ClientConfig:
    """Where the client connects; `LLMFLEET_ENDPOINT` sets it (through `config.from_env`)."""

    endpoint: str = DEFAULT_ENDPOINT


class ClientError(LLMFleetError):
    """A failed call. `code_name` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code_name: str, message: str) -> None:
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name
        self.message = message

    @property
    def is_invalid_argument(self) -> bool:
        return self.code_name in ("INVALID_ARGUMENT", "OUT_OF_RANGE")


def _client_error(exc: grpc.RpcError) -> ClientError:
    # Sync errors are grpc.Call objects, grpc.aio's AioRpcError is not; both have these.
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return ClientError(name, details or str(exc))


# ---- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one generated position (field names as the engine's `TokenLogprobs`)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


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
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str = ""
    stop_token_id: int | None = None


@dataclass
class GenerateResult:
    request_id: str
    completions: list[Completion]
    usage: Usage | None = None


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    max_n: int
    max_logprobs: int
    block_size: int


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


# ---- protobuf conversion ------------------------------------------------------------------


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
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
    keep_special_tokens: bool = False,
    add_generation_prompt: bool | None = None,
    request_id: str | None = None,
    cache_salt: str = "",
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; values are checked by the server."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValidationError("prompt", "give exactly one of prompt, messages or token_ids")
    if isinstance(stop, str):
        raise ValidationError("stop", "must be a list of strings, not a single string")
    sampling = common_pb2.SamplingParams(
        stop=list(stop),
        stop_token_ids=_token_ids("stop_token_ids", stop_token_ids),
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop_str_in_output,
        keep_special_tokens=keep_special_tokens,
    )
    optional = {
        "n": n, "max_tokens": max_tokens, "min_tokens": min_tokens, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
        "seed": seed, "logprobs": logprobs,
    }  # fmt: skip
    for name, value in optional.items():
        if value is not None:
            try:
                setattr(sampling, name, value)
            except (TypeError, ValueError) as exc:
                raise ValidationError(name, f"bad value {value!r}: {exc}") from None
    req = generation_pb2.GenerateRequest(
        request_id=request_id or "", sampling=sampling, cache_salt=cache_salt
    )
    if token_ids is not None:
        req.tokens.token_ids.extend(_token_ids("token_ids", token_ids))
    elif messages is not None:
        chat = common_pb2.ChatPrompt(messages=_chat_messages(messages))
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


def _chat_messages(messages: Sequence[Mapping[str, str]]) -> list[common_pb2.ChatMessage]:
    if isinstance(messages, (str, bytes)):
        raise ValidationError("messages", "must be a list of {role, content} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValidationError(f"messages[{i}]", "must be a mapping with role and content")
        role, content = m.get("role", ""), m.get("content", "")
        if not isinstance(role, str):
            raise ValidationError(f"messages[{i}].role", "must be a string")
        if not isinstance(content, str):
            raise ValidationError(f"messages[{i}].content", "must be a string")
        out.append(common_pb2.ChatMessage(role=role, content=content))
    return out


def _logprobs(pb: common_pb2.PositionLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=pb.sampled.token_id,
        logprob=pb.sampled.logprob,
        rank=pb.rank,
        top_token_ids=[t.token_id for t in pb.top],
        top_logprobs=[t.logprob for t in pb.top],
    )


def _delta(pb: generation_pb2.CompletionDelta) -> Delta:
    return Delta(
        index=pb.index,
        text=pb.text,
        token_ids=list(pb.token_ids),
        finish_reason=_FINISH.get(pb.finish_reason),
        logprobs=[_logprobs(lp) for lp in pb.logprobs],
        stop_string=pb.stop_string,
        stop_token_id=pb.stop_token_id if pb.HasField("stop_token_id") else None,
    )


def _usage(pb: generation_pb2.GenerateResponse) -> Usage | None:
    if not pb.HasField("usage"):
        return None
    u = pb.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


class _Accumulator:
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


def _model_info(pb: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    m = pb.model
    return ModelInfo(
        model_id=m.model_id,
        architecture=m.architecture,
        vocab_size=m.vocab_size,
        max_model_len=m.max_model_len,
        eos_token_ids=list(m.eos_token_ids),
        max_n=m.max_n,
        max_logprobs=m.max_logprobs,
        block_size=m.block_size,
    )


def _server_info(pb: generation_pb2.GetServerInfoResponse) -> ServerInfo:
    return ServerInfo(
        version=pb.version,
        mode=pb.mode,
        routing_policy=pb.routing_policy,
        workers=[
            WorkerStatus(
                worker_id=w.worker_id,
                role=_ROLES.get(w.role, "unspecified"),
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


# ---- sync client --------------------------------------------------------------------------


class GenerateStream:
    """Iterator of `Delta`s of one Generate call; `request_id` and `usage` fill in as it runs.

    Leaving the loop early (break, exception, `close()`) cancels the call on the server.
    """

    def __init__(self, call: Any, n: int) -> None:
        self._call = call
        self._acc = _Accumulator(n)

    @property
    def request_id(self) -> str:
        return self._acc.result.request_id

    @property
    def usage(self) -> Usage | None:
        return self._acc.result.usage

    @property
    def result(self) -> GenerateResult:
        """Everything received so far."""
        return self._acc.result

    def __iter__(self) -> Iterator[Delta]:
        try:
            for pb in self._call:
                yield from self._acc.add(pb)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            self._call.cancel()  # no-op once the call has ended

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GenerationClient:
    """Blocking client over one gRPC channel; thread-safe (grpc channels are)."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT) -> None:
        self.endpoint = endpoint
        self._channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> GenerateStream:
        """Start a Generate call (arguments as `build_request`); iterate it for `Delta`s."""
        req = build_request(prompt, **kwargs)
        # An application's current span (if any) becomes the parent of the fleet's llm_request.
        call = self._stub.Generate(req, timeout=timeout, metadata=metadata())
        return GenerateStream(call, _num_completions(req))

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> GenerateResult:
        """Run one request to the end (arguments as `build_request`)."""
        stream = self.stream(prompt, timeout=timeout, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def abort(self, request_id: str, *, timeout: float | None = 10.0) -> bool:
        """Abort a running request; False when the server knows no running request by that id."""
        req = generation_pb2.AbortRequest(request_id=request_id)
        return self._unary(self._stub.Abort, req, timeout).found

    def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        req = generation_pb2.GetModelInfoRequest()
        return _model_info(self._unary(self._stub.GetModelInfo, req, timeout))

    def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        req = generation_pb2.GetServerInfoRequest()
        return _server_info(self._unary(self._stub.GetServerInfo, req, timeout))

    @staticmethod
    def _unary(method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return method(req, timeout=timeout)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _num_completions(req: generation_pb2.GenerateRequest) -> int:
    n = req.sampling.n if req.sampling.HasField("n") else 1
    return n if 1 <= n <= 1024 else 1  # out-of-range n is the server's to reject


# ---- async client -------------------------------------------------------------------------


class AsyncGenerateStream:
    """Async iterator of `Delta`s of one Generate call (see `GenerateStream`)."""

    def __init__(self, call: Any, n: int) -> None:
        self._call = call
        self._acc = _Accumulator(n)

    @property
    def request_id(self) -> str:
        return self._acc.result.request_id

    @property
    def usage(self) -> Usage | None:
        return self._acc.result.usage

    @property
    def result(self) -> GenerateResult:
        return self._acc.result

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for pb in self._call:
                for delta in self._acc.add(pb):
                    yield delta
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class AsyncGenerationClient:
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT) -> None:
        self.endpoint = endpoint
        self._channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncGenerateStream:
        req = build_request(prompt, **kwargs)
        # An application's current span (if any) becomes the parent of the fleet's llm_request.
        call = self._stub.Generate(req, timeout=timeout, metadata=metadata())
        return AsyncGenerateStream(call, _num_completions(req))

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> GenerateResult:
        stream = self.stream(prompt, timeout=timeout, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    async def abort(self, request_id: str, *, timeout: float | None = 10.0) -> bool:
        req = generation_pb2.AbortRequest(request_id=request_id)
        return (await self._unary(self._stub.Abort, req, timeout)).found

    async def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        req = generation_pb2.GetModelInfoRequest()
        return _model_info(await self._unary(self._stub.GetModelInfo, req, timeout))

    async def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        req = generation_pb2.GetServerInfoRequest()
        return _server_info(await self._unary(self._stub.GetServerInfo, req, timeout))

    @staticmethod
    async def _unary(method: Any, req: Any, timeout: float | None) -> Any:
        try:
            return await method(req, timeout=timeout)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
