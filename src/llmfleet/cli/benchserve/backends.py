"""Benchmark backends: send one `SampleRequest`, stream its answer, time every chunk.

- `GrpcBackend`: the public gRPC API (`Generation.Generate`, server streaming) through
  `AsyncGenerationClient`; token-id prompts go as `tokens`, text as a raw (no chat template)
  prompt. Output tokens come from the final `Usage`.
- `OpenAIBackend`: an OpenAI-compatible HTTP server, `/v1/completions` (`chat=False`) or
  `/v1/chat/completions` (`chat=True`), streamed as server-sent events with
  `stream_options.include_usage`, so the last event before `data: [DONE]` carries the usage.

A "chunk" is one streamed message carrying new tokens (gRPC: a response with token ids;
SSE: an event with non-empty text). Its arrival is a token time: the first one gives the TTFT,
the gaps between the following ones the ITLs. (Over SSE a token without text, e.g. a special
token, has no event of its own: it is timed with the next text.) `send` never raises for a
failed request: it records `success=False` and the error's text, so one failure does not end a
benchmark.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from llmfleet.cli.benchserve.datasets import SampleRequest
from llmfleet.cli.benchserve.stats import RequestRecord
from llmfleet.shared.core.errors import LLMFleetError, ValidationError

logger = logging.getLogger(__name__)

BACKENDS = ("grpc", "openai", "openai-chat")
_ERROR_BODY_CHARS = 500


class Backend(Protocol):
    target: str  # where it sends: a gRPC endpoint or a base URL

    async def model(self) -> tuple[str, int | None]:
        """The served model's id and vocabulary size (None where the API does not say); also
        checks the server answers at all."""
        ...

    async def send(self, req: SampleRequest, record: RequestRecord, t0: float) -> None:
        """Run `req`, filling `record` (times relative to `t0`, a `perf_counter` value)."""
        ...

    async def close(self) -> None: ...


class _Timing:
    """Fills a record's start, TTFT, ITLs and latency from `perf_counter` readings."""

    def __init__(self, record: RequestRecord, t0: float) -> None:
        self.record = record
        self.start = time.perf_counter()
        self.last: float | None = None
        self.num_chunks = 0
        record.start_s = self.start - t0

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def finish(self, *, error: str = "") -> None:
        self.record.latency_s = time.perf_counter() - self.start
        if not error and self.num_chunks == 0:
            error = "the response carried no tokens"
        self.record.success = not error
        self.record.error = error


class GrpcBackend:
    """The public gRPC API. Create and use it inside one running event loop."""

    def __init__(
        self,
        endpoint: str,
        *,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        timeout_s: float | None = None,
        api_key: str | None = None,
    ) -> None:
        from llmfleet.client.generation import AsyncGenerationClient

        self.target = endpoint
        self._client = AsyncGenerationClient(endpoint, api_key=api_key)
        self._sampling: dict[str, Any] = {"temperature": temperature, "ignore_eos": ignore_eos}
        self._timeout = timeout_s

    async def model(self) -> tuple[str, int | None]:
        info = await self._client.model_info()
        return info.model_id, info.vocab_size

    async def send(self, req: SampleRequest, record: RequestRecord, t0: float) -> None:
        if isinstance(req.prompt, list):
            prompt: dict[str, Any] = {"token_ids": req.prompt}
        else:
            prompt = {"prompt": req.prompt, "raw": True}
        timing = _Timing(record, t0)
        counted = 0
        error = ""
        try:
            stream = self._client.stream(
                **prompt,
                max_tokens=req.expected_output_len,
                timeout=self._timeout,
                **self._sampling,
            )
            async for delta in stream:
                if delta.token_ids:
                    timing.chunk()
                    counted += len(delta.token_ids)
            usage = stream.usage
            record.output_tokens = usage.completion_tokens if usage else counted
            if usage is not None:
                record.prompt_len = usage.prompt_tokens
                record.cached_tokens = usage.cached_prompt_tokens
        except LLMFleetError as exc:  # ClientError: the call failed (status and message)
            error = str(exc)
        timing.finish(error=error)

    async def close(self) -> None:
        await self._client.close()


async def _sse_data(content: Any) -> AsyncIterator[str]:
    """The `data` payloads of a server-sent event stream (one line per event, as OpenAI's)."""
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            yield line[5:].lstrip(" ")


class OpenAIBackend:
    """An OpenAI-compatible HTTP endpoint over aiohttp; one session for all requests."""

    def __init__(
        self,
        base_url: str,
        *,
        chat: bool,
        model: str | None = None,
        endpoint_path: str | None = None,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        timeout_s: float | None = None,
        max_connections: int | None = None,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValidationError("--base-url", f"must start with http:// or https://: {base_url}")
        self.target = base_url.rstrip("/")
        self._chat = chat
        default_path = "/v1/chat/completions" if chat else "/v1/completions"
        self._url = self.target + (endpoint_path or default_path)
        self._model = model
        self._sampling: dict[str, Any] = {"temperature": temperature, "ignore_eos": ignore_eos}
        self._timeout_s = timeout_s
        self._max_connections = max_connections or 0  # 0: no limit
        self._session: Any = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _http(self) -> Any:  # -> aiohttp.ClientSession, created inside the running loop
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                headers=self._headers,
            )
        return self._session

    async def model(self) -> tuple[str, int | None]:
        return await self.model_id(), None

    async def model_id(self) -> str:
        import aiohttp

        url = self.target + "/v1/models"
        try:
            # Not kept alive: building the dataset after this probe can outlast the server's
            # keep-alive timeout (uvicorn's: 5 s), and the first request would then be written
            # to a connection the server has closed ("Can not write request body").
            async with self._http().get(url, headers={"Connection": "close"}) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise LLMFleetError(f"GET {url}: HTTP {resp.status}: {body[:200]}")
        except aiohttp.ClientError as exc:
            raise LLMFleetError(f"cannot reach {url}: {exc}") from None
        ids = [m.get("id") for m in json.loads(body).get("data", []) if isinstance(m, dict)]
        if self._model is not None:
            if self._model not in ids:
                logger.warning("model %r is not among %s served at %s", self._model, ids, url)
            return self._model
        if not ids:
            raise LLMFleetError(f"GET {url} lists no model; pass --model")
        self._model = str(ids[0])
        return self._model

    def _payload(self, req: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._model,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self._sampling,
        }
        if self._chat:
            if not isinstance(req.prompt, str):
                raise ValidationError("prompt", "the chat backend needs text prompts")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.expected_output_len
        else:
            body["prompt"] = req.prompt  # text, or token ids (the completions API takes both)
            body["max_tokens"] = req.expected_output_len
        return body

    def _chunk_text(self, choice: dict[str, Any]) -> str:
        if self._chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    async def send(self, req: SampleRequest, record: RequestRecord, t0: float) -> None:
        import aiohttp

        if self._model is None:
            await self.model_id()
        payload = self._payload(req)
        timing = _Timing(record, t0)
        error = ""
        usage: dict[str, Any] | None = None
        try:
            async with self._http().post(self._url, json=payload) as resp:
                if resp.status != 200:
                    body = await resp.text()
                    error = f"HTTP {resp.status}: {body[:_ERROR_BODY_CHARS]}"
                else:
                    async for data in _sse_data(resp.content):
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if event.get("error"):
                            error = f"error event: {json.dumps(event['error'])}"
                            break
                        choices = event.get("choices") or []
                        if choices and self._chunk_text(choices[0]):
                            timing.chunk()
                        usage = event.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        except json.JSONDecodeError as exc:
            error = f"malformed server-sent event: {exc}"
        if not error and usage is None:
            error = "the stream ended without usage (stream_options.include_usage)"
        if usage is not None:
            record.output_tokens = int(usage.get("completion_tokens", 0))
            record.prompt_len = int(usage.get("prompt_tokens", record.prompt_len))
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
        timing.finish(error=error)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
