"""Protobuf <-> core for embeddings (embedding.proto): the request's pooling parameters, its
inputs, and the response. Field names in errors are the proto's (`pooling`, `dimensions`,
`inputs[i]`), which the gateway maps back to the names its clients used."""

from __future__ import annotations

from collections.abc import Sequence

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.pooling_params import PoolingParams
from llmfleet.v1 import embedding_pb2

POOLING_FROM_PB = {
    embedding_pb2.POOLING_UNSPECIFIED: "last",
    embedding_pb2.POOLING_LAST: "last",
    embedding_pb2.POOLING_MEAN: "mean",
}
POOLING_TO_PB = {"last": embedding_pb2.POOLING_LAST, "mean": embedding_pb2.POOLING_MEAN}


def pooling_from_pb(req: embedding_pb2.EmbedRequest) -> PoolingParams:
    pooling = POOLING_FROM_PB.get(req.pooling)
    if pooling is None:
        raise ValidationError("pooling", f"unknown pooling {req.pooling}")
    return PoolingParams(
        pooling=pooling,  # type: ignore[arg-type]
        normalize=req.normalize if req.HasField("normalize") else True,
        dimensions=req.dimensions if req.HasField("dimensions") else None,
    )


def pooling_to_pb(params: PoolingParams, req: embedding_pb2.EmbedRequest) -> None:
    """Set `req`'s pooling fields from `params`."""
    req.pooling = POOLING_TO_PB[params.pooling]
    req.normalize = params.normalize
    if params.dimensions is not None:
        req.dimensions = params.dimensions


def check_inputs(req: embedding_pb2.EmbedRequest) -> None:
    """ValidationError naming `inputs` or `inputs[i]` for a missing or empty input."""
    if not req.inputs:
        raise ValidationError("inputs", "must not be empty")
    for i, inp in enumerate(req.inputs):
        kind = inp.WhichOneof("input")
        if kind is None:
            raise ValidationError(f"inputs[{i}]", "set text or tokens")
        if (kind == "text" and not inp.text) or (kind == "tokens" and not inp.tokens.token_ids):
            raise ValidationError(f"inputs[{i}]", "must not be empty")


def token_inputs(token_ids: Sequence[Sequence[int]]) -> list[embedding_pb2.EmbedInput]:
    return [
        embedding_pb2.EmbedInput(tokens=embedding_pb2.EmbedTokens(token_ids=list(ids)))
        for ids in token_ids
    ]


def response_to_pb(
    request_id: str, embeddings: Sequence[tuple[Sequence[float], int]]
) -> embedding_pb2.EmbedResponse:
    """(values, num_prompt_tokens) of each input, in order."""
    return embedding_pb2.EmbedResponse(
        request_id=request_id,
        embeddings=[
            embedding_pb2.Embedding(values=list(v), num_prompt_tokens=n) for v, n in embeddings
        ],
        num_prompt_tokens=sum(n for _, n in embeddings),
    )
