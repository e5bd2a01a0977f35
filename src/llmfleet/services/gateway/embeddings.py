"""OpenAI's Embeddings API: `POST /v1/embeddings`, one gRPC `Embed` call to the router.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists (one
embedding each, in order; strings are tokenized as raw text, no chat template). The answer is
OpenAI's `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}` with vLLM's `id` and `created`; `encoding_format` "base64" sends each vector as the
base64 of its little-endian float32 bytes (what the official SDKs ask for by default and
decode). `dimensions` shortens and renormalizes the vectors where the model was trained for
it (Matryoshka), else is a 400 naming it, as vLLM does; `user` is accepted and ignored.

vLLM-style extras: `normalize` (default true) and `pooling` ("last", the default for decoder
LMs, or "mean"). Errors name the OpenAI parameter (`input`, `input[i]`, `dimensions`).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmfleet.client.generation import ClientError
from llmfleet.services.gateway.auth import caller_key
from llmfleet.services.gateway.errors import APIError, from_client_error, invalid
from llmfleet.services.gateway.upstream import Upstream
from llmfleet.shared.wire.embedding import POOLING_TO_PB
from llmfleet.v1 import embedding_pb2

ROUTES = ("/v1/embeddings",)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    normalize: bool = True
    pooling: Literal["last", "mean"] = "last"


def install(app: FastAPI) -> None:
    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        up: Upstream = request.app.state.upstream
        served = await up.require(body.model)
        single = isinstance(body.input, str) or (
            bool(body.input) and isinstance(body.input[0], int)
        )
        try:
            resp = await up.client.embed(to_pb(body), api_key=caller_key(request.headers))
        except ClientError as exc:
            raise _api_error(exc, single) from None
        return JSONResponse(to_json(resp, served.name, body.encoding_format))


def to_pb(body: EmbeddingRequest) -> embedding_pb2.EmbedRequest:
    """The Embed request of `body`; a 400 naming `input` or `dimensions` for what the router
    would refuse by shape alone."""
    raw = body.input
    items: Sequence[Any] = [raw] if isinstance(raw, str) or _is_token_list(raw) else raw
    if not items:
        raise invalid("input", "input: must not be empty")
    inputs = []
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 and items is not raw else f"input[{i}]"
        if not item:
            raise invalid(param, f"{param}: must not be empty")
        if isinstance(item, str):
            inputs.append(embedding_pb2.EmbedInput(text=item))
        elif any(not 0 <= t < 2**63 for t in item):
            raise invalid(param, f"{param}: token ids must be non-negative 64-bit integers")
        else:
            inputs.append(
                embedding_pb2.EmbedInput(tokens=embedding_pb2.EmbedTokens(token_ids=item))
            )
    req = embedding_pb2.EmbedRequest(
        request_id=f"embd-{uuid.uuid4().hex}",
        inputs=inputs,
        pooling=POOLING_TO_PB[body.pooling],
        normalize=body.normalize,
    )
    if body.dimensions is not None:
        if body.dimensions < 1:
            raise invalid("dimensions", f"dimensions: must be at least 1, got {body.dimensions}")
        req.dimensions = body.dimensions
    return req


def _is_token_list(raw: Any) -> bool:
    return isinstance(raw, list) and bool(raw) and isinstance(raw[0], int)


def to_json(resp: embedding_pb2.EmbedResponse, model: str, encoding: str) -> dict[str, Any]:
    data = []
    for i, e in enumerate(resp.embeddings):
        values = list(e.values)
        vector: list[float] | str = values
        if encoding == "base64":  # little-endian float32, as OpenAI sends it
            vector = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    n = resp.num_prompt_tokens
    return {
        "id": resp.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


def _api_error(exc: ClientError, single: bool) -> APIError:
    """The router's error with its field as the client spelled it: `inputs[i]` is `input[i]`
    (`input` when the client sent one input)."""
    err = from_client_error(exc)
    if err.param is not None and err.param.startswith("inputs"):
        param = "input" if single or err.param == "inputs" else "input" + err.param[6:]
        err.message = param + err.message[len(err.param) :]
        err.param = param
        err.args = (err.message,)
    return err
