"""Clients of the public API (`llmfleet.v1.Generation`, served by the router).

    with GenerationClient("127.0.0.1:50051") as client:
        res = client.generate("What is the capital of France?", max_tokens=32, temperature=0)
        print(res.completions[0].text, res.usage)
        for delta in client.stream("Tell me a story.", max_tokens=64):
            print(delta.text, end="", flush=True)

    async with AsyncGenerationClient("127.0.0.1:50051", api_key="sk-...") as client:
        res = await client.generate(messages=[{"role": "user", "content": "Hi"}])
        async for delta in client.stream(token_ids=[1, 2, 3], raw=True):
            ...

A plain `str` prompt is sent as one user chat message (the model's chat template applies) unless
`raw=True`, which sends it as text to be completed as is. Sampling arguments left as None take
the server's defaults (see `SamplingParams` in common.proto). Every gRPC failure surfaces as
`ClientError(code_name, message)` carrying the server's message. A client's `api_key` goes
with every call as `authorization: Bearer <key>` metadata (a fleet with keys needs it).

The blocking and the asyncio client share everything but the waiting: requests are built and
responses parsed once (`messages.py`, `_Calls`); each client only invokes the stub. This module
imports grpc and the generated messages, never torch, so the CLI starts fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from llmfleet.client.messages import (
    Accumulator,
    Delta,
    GenerateResult,
    ServerInfo,
    Usage,
    build_request,
    num_completions,
    server_info_from_pb,
)
from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.wire.api_key_auth import auth_metadata
from llmfleet.shared.wire.convert import model_info_from_pb
from llmfleet.shared.wire.limits import pushback_s
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import embedding_pb2, generation_pb2, generation_pb2_grpc

DEFAULT_ENDPOINT = "127.0.0.1:50051"
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class ClientConfig:
    """Where the client connects and the API key it sends; `LLMFLEET_ENDPOINT` and
    `LLMFLEET_API_KEY` set them (through `config.from_env`)."""

    endpoint: str = DEFAULT_ENDPOINT
    api_key: str | None = field(default=None, repr=False)


class ClientError(LLMFleetError):
    """A failed call. `code_name` is the gRPC status name (e.g. "INVALID_ARGUMENT");
    `retry_after_s`: the server's retry pushback (overload), None when it sent none."""

    def __init__(self, code_name: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def is_invalid_argument(self) -> bool:
        return self.code_name in ("INVALID_ARGUMENT", "OUT_OF_RANGE")


def _client_error(exc: grpc.RpcError) -> ClientError:
    # Sync errors are grpc.Call objects, grpc.aio's AioRpcError is not; both have these.
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return ClientError(name, details or str(exc), pushback_s(trailing))


# A unary RPC: (stub method name, request message, the response's conversion).
_Unary = tuple[str, Message, Callable[[Any], Any]]


class _Calls:
    """What both clients send and how they read the answers; subclasses only invoke."""

    def __init__(self, endpoint: str, channel: Any, api_key: str | None) -> None:
        self.endpoint = endpoint
        self._channel = channel
        self._stub = generation_pb2_grpc.GenerationStub(channel)
        self._auth = auth_metadata(api_key)  # `authorization: Bearer <key>` on every call

    def _start_generate(
        self,
        prompt: str | None,
        timeout: float | None,
        api_key: str | None,
        kwargs: Any,
        extra: Sequence[tuple[str, str]] = (),
    ) -> Any:
        req = build_request(prompt, **kwargs)
        auth = auth_metadata(api_key) if api_key else self._auth
        # An application's current span (if any) becomes the parent of the fleet's llm_request.
        md = [*(metadata() or ()), *auth, *extra]
        call = self._stub.Generate(req, timeout=timeout, metadata=md or None)
        return call, num_completions(req)

    def _call_metadata(self, api_key: str | None) -> list[tuple[str, str]] | None:
        """A unary call's metadata: the trace context and `api_key` (else the client's)."""
        auth = auth_metadata(api_key) if api_key else self._auth
        return [*(metadata() or ()), *auth] or None

    @staticmethod
    def _abort(request_id: str) -> _Unary:
        return "Abort", generation_pb2.AbortRequest(request_id=request_id), lambda r: r.found

    @staticmethod
    def _model_info() -> _Unary:
        req = generation_pb2.GetModelInfoRequest()
        return "GetModelInfo", req, lambda r: model_info_from_pb(r.model)

    @staticmethod
    def _server_info() -> _Unary:
        return "GetServerInfo", generation_pb2.GetServerInfoRequest(), server_info_from_pb


class _StreamState:
    """A Generate call and what it has delivered so far."""

    def __init__(self, call: Any, n: int) -> None:
        self._call = call
        self._acc = Accumulator(n)

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

    def cancel(self) -> None:
        """Cancel the call on the server (a no-op once it has ended)."""
        self._call.cancel()


# ---- blocking ----------------------------------------------------------------------------


class GenerateStream(_StreamState):
    """Iterator of `Delta`s of one Generate call; `request_id` and `usage` fill in as it runs.

    Leaving the loop early (break, exception, `close()`) cancels the call on the server.
    """

    def __iter__(self) -> Iterator[Delta]:
        try:
            for pb in self._call:
                yield from self._acc.add(pb)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            self._call.cancel()

    close = _StreamState.cancel

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GenerationClient(_Calls):
    """Blocking client over one gRPC channel; thread-safe (grpc channels are)."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, api_key: str | None = None) -> None:
        channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        super().__init__(endpoint, channel, api_key)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **kwargs: Any,
    ) -> GenerateStream:
        """Start a Generate call (arguments as `build_request`; `api_key` over the client's;
        `metadata`: more call metadata, e.g. a worker pin); iterate it for `Delta`s."""
        return GenerateStream(*self._start_generate(prompt, timeout, api_key, kwargs, metadata))

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
        return self._unary(self._abort(request_id), timeout)

    def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        return self._unary(self._model_info(), timeout)

    def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        return self._unary(self._server_info(), timeout)

    def embed(
        self,
        request: embedding_pb2.EmbedRequest,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
    ) -> embedding_pb2.EmbedResponse:
        """One Embed call (embedding.proto); ClientError on failure."""
        try:
            return self._stub.Embed(request, timeout=timeout, metadata=self._call_metadata(api_key))
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    def _unary(self, rpc: _Unary, timeout: float | None) -> Any:
        method, req, parse = rpc
        try:
            md = self._auth or None
            return parse(getattr(self._stub, method)(req, timeout=timeout, metadata=md))
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- asyncio -----------------------------------------------------------------------------


class AsyncGenerateStream(_StreamState):
    """Async iterator of `Delta`s of one Generate call (see `GenerateStream`)."""

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for pb in self._call:
                for delta in self._acc.add(pb):
                    yield delta
        except grpc.RpcError as exc:
            raise _client_error(exc) from None
        finally:
            self._call.cancel()


class AsyncGenerationClient(_Calls):
    """grpc.aio client; create and use it inside one running event loop."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, api_key: str | None = None) -> None:
        channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        super().__init__(endpoint, channel, api_key)

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **kwargs: Any,
    ) -> AsyncGenerateStream:
        return AsyncGenerateStream(
            *self._start_generate(prompt, timeout, api_key, kwargs, metadata)
        )

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> GenerateResult:
        stream = self.stream(prompt, timeout=timeout, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    async def abort(self, request_id: str, *, timeout: float | None = 10.0) -> bool:
        return await self._unary(self._abort(request_id), timeout)

    async def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        return await self._unary(self._model_info(), timeout)

    async def server_info(self, *, timeout: float | None = 10.0) -> ServerInfo:
        return await self._unary(self._server_info(), timeout)

    async def embed(
        self,
        request: embedding_pb2.EmbedRequest,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
    ) -> embedding_pb2.EmbedResponse:
        """One Embed call (embedding.proto); ClientError on failure."""
        md = self._call_metadata(api_key)
        try:
            return await self._stub.Embed(request, timeout=timeout, metadata=md)
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    async def _unary(self, rpc: _Unary, timeout: float | None) -> Any:
        method, req, parse = rpc
        try:
            md = self._auth or None
            return parse(await getattr(self._stub, method)(req, timeout=timeout, metadata=md))
        except grpc.RpcError as exc:
            raise _client_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
