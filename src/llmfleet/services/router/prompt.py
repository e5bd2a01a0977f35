"""A Generate request's prompt and sampling, validated: first its shape, then against the model.

    kind, params = check_shape(req)                          # before admission
    ids, images = await prompt_token_ids(tokenizer, req, kind, model)  # tokenizer: text, chat
    check_sampling(params, model, len(ids))

Errors are `ValidationError`s naming the request field (`text`, `tokens.token_ids`,
`chat.messages[0].role`, `sampling.max_tokens`, ...); a tokenizer that cannot be reached is
`Unavailable`. A prompt longer than the context is an error of the prompt's field naming its
length and the limit (found by the tokenizer, before tokenizing all of a text too long by a
cheap bound); `sampling.max_tokens` is blamed only when the prompt fits but leaves no room.
A chat's images come back from the tokenizer as `ImageRef`s (placeholder runs in the ids, each
naming the media store that holds its pixels).
"""

from __future__ import annotations

import grpc
from opentelemetry.context import Context

from llmfleet.services.router.placement import CONTROL_TIMEOUT_S, field_error
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import ImageRef
from llmfleet.shared.core.sampling_params import SamplingLimits, SamplingParams
from llmfleet.shared.core.structured_output import parse_grammar
from llmfleet.shared.wire.convert import images_from_pb, sampling_from_pb
from llmfleet.shared.wire.service import Unavailable
from llmfleet.shared.wire.tracing import metadata
from llmfleet.v1 import generation_pb2, tokenizer_pb2, tokenizer_pb2_grpc


def check_shape(req: generation_pb2.GenerateRequest) -> tuple[str, SamplingParams]:
    """The prompt kind ("text", "tokens" or "chat") and the sampling parameters."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt", "set exactly one of text, tokens or chat")
    params = sampling_from_pb(req.sampling)
    if params.structured_output is not None:
        # Parsed without a vocabulary: a bad schema, regex or grammar fails here, before any
        # routing; the worker compiles it against the vocabulary.
        try:
            parse_grammar(params.structured_output)
        except ValidationError as e:
            raise ValidationError(f"sampling.{e.field}", e.message) from None
    if kind == "text" and not req.text:
        raise ValidationError("text", "must not be empty")
    if kind == "tokens" and not req.tokens.token_ids:
        raise ValidationError("tokens.token_ids", "must not be empty")
    return kind, params


async def prompt_token_ids(
    tokenizer: tokenizer_pb2_grpc.TokenizerStub,
    req: generation_pb2.GenerateRequest,
    kind: str,
    model: ModelInfo,
    trace: Context | None = None,
) -> tuple[list[int], tuple[ImageRef, ...]]:
    """The prompt's token ids and images (`trace`: the request's context, sent along to the
    tokenizer)."""
    if kind == "tokens":
        ids = list(req.tokens.token_ids)
        if len(ids) > model.max_model_len:
            raise ValidationError(
                "tokens.token_ids",
                f"the prompt has {len(ids)} tokens, more than the context length of "
                f"{model.max_model_len} tokens",
            )
        for i, t in enumerate(ids):
            if not 0 <= t < model.vocab_size:
                raise ValidationError(
                    "tokens.token_ids",
                    f"token id {t} at position {i} is outside the vocabulary "
                    f"[0, {model.vocab_size})",
                )
        return ids, ()
    # The tokenizer refuses a prompt longer than the context, without tokenizing a text that
    # is too long by its cheap bound.
    limit = model.max_model_len
    tok_req = (
        tokenizer_pb2.TokenizeRequest(text=req.text, max_num_tokens=limit)
        if kind == "text"
        else tokenizer_pb2.TokenizeRequest(chat=req.chat, max_num_tokens=limit)
    )
    try:
        resp = await tokenizer.Tokenize(  # waits out a reconnection, within the timeout
            tok_req, timeout=CONTROL_TIMEOUT_S, metadata=metadata(trace), wait_for_ready=True
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
            raise field_error(exc.details(), kind) from None
        raise Unavailable(f"tokenizer: {exc.code().name}: {exc.details()}") from None
    if not resp.token_ids:
        raise ValidationError(kind, "the prompt has no tokens")
    if len(resp.token_ids) > limit:  # a tokenizer that does not check max_num_tokens
        raise ValidationError(
            "text" if kind == "text" else "chat.messages",
            f"the prompt has {len(resp.token_ids)} tokens, more than the context length of "
            f"{limit} tokens",
        )
    ids = list(resp.token_ids)
    return ids, images_from_pb(resp.images, len(ids), "chat.messages")


def check_sampling(params: SamplingParams, model: ModelInfo, num_prompt_tokens: int) -> None:
    limits = SamplingLimits(max_n=model.max_n, max_logprobs=model.max_logprobs)
    try:
        params.check_against(
            limits, num_prompt_tokens=num_prompt_tokens, max_model_len=model.max_model_len
        )
    except ValidationError as exc:
        raise ValidationError(f"sampling.{exc.field}", exc.message) from None
