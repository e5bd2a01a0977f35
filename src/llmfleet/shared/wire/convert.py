"""Protobuf <-> core dataclass conversion, in one place (the servicers' `from_pb`/`to_pb`).

Core code never sees `*_pb2`; servicers call these at the boundary. Validation errors name the
field by its path in the request message (e.g. `sampling.temperature`).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import ImageRef, check_images
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.structured_output import StructuredOutput
from llmfleet.v1 import common_pb2

_OPTIONAL_SAMPLING = (
    "n", "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
    "skip_special_tokens", "speculative",
)  # fmt: skip

FINISH_TO_PB = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
ROLE_TO_PB = {
    "unified": common_pb2.WORKER_ROLE_UNIFIED,
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}


def sampling_from_pb(pb: common_pb2.SamplingParams, prefix: str = "sampling") -> SamplingParams:
    kwargs: dict[str, object] = {
        name: getattr(pb, name) for name in _OPTIONAL_SAMPLING if pb.HasField(name)
    }
    try:
        structured = (
            structured_output_from_pb(pb.structured_output)
            if pb.HasField("structured_output")
            else None
        )
        return SamplingParams(
            stop=tuple(pb.stop),
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
            include_stop_str_in_output=pb.include_stop_str_in_output,
            structured_output=structured,
            **kwargs,  # type: ignore[arg-type]
        )
    except ValidationError as e:
        raise ValidationError(f"{prefix}.{e.field}", e.message) from None


def structured_output_from_pb(pb: common_pb2.StructuredOutput) -> StructuredOutput:
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise ValidationError("structured_output", "set but empty: name one kind of constraint")
    if kind == "json_object":
        if not pb.json_object:
            raise ValidationError("structured_output.json_object", "must be true when set")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(pb.choice.choices))
    return StructuredOutput(kind, spec=getattr(pb, kind))


def structured_output_to_pb(s: StructuredOutput) -> common_pb2.StructuredOutput:
    if s.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if s.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=list(s.choices)))
    return common_pb2.StructuredOutput(**{s.kind: s.spec})


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        n=p.n,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        pb.seed = p.seed
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    if p.speculative is not None:
        pb.speculative = p.speculative
    if p.structured_output is not None:
        pb.structured_output.CopyFrom(structured_output_to_pb(p.structured_output))
    return pb


def logprobs_to_pb(lp: TokenLogprobs) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob),
        rank=lp.rank,
        top=[
            common_pb2.TokenLogprob(token_id=t, logprob=v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ],
    )


def logprobs_from_pb(pb: common_pb2.PositionLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=pb.sampled.token_id,
        logprob=pb.sampled.logprob,
        rank=pb.rank,
        top_token_ids=[t.token_id for t in pb.top],
        top_logprobs=[t.logprob for t in pb.top],
    )


def model_info_to_pb(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=info.model_id,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        eos_token_ids=list(info.eos_token_ids),
        max_n=info.max_n,
        max_logprobs=info.max_logprobs,
        block_size=info.block_size,
    )


def model_info_from_pb(pb: common_pb2.ModelInfo) -> ModelInfo:
    """Raises ValidationError naming the `model.*` field that is missing or out of range."""
    return ModelInfo(
        model_id=pb.model_id,
        architecture=pb.architecture,
        vocab_size=pb.vocab_size,
        max_model_len=pb.max_model_len,
        eos_token_ids=tuple(pb.eos_token_ids),
        max_n=pb.max_n or 1,
        max_logprobs=pb.max_logprobs,
        block_size=pb.block_size,
    )


def token_ids_from_pb(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    """Check ids are inside the vocabulary; the error names `field` and the position."""
    out = list(ids)
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise ValidationError(
                field, f"token id {t} at position {i} is outside the vocabulary [0, {vocab_size})"
            )
    return out


def images_to_pb(images: Sequence[ImageRef]) -> list[common_pb2.ImageRef]:
    return [
        common_pb2.ImageRef(
            content_hash=im.content_hash,
            offset=im.offset,
            length=im.length,
            grid=list(im.grid),
            media_endpoint=im.media_endpoint,
        )
        for im in images
    ]


def images_from_pb(
    pbs: Sequence[common_pb2.ImageRef], num_prompt_tokens: int, field: str
) -> tuple[ImageRef, ...]:
    """The images of a prompt of `num_prompt_tokens` tokens; ValidationError naming `field`
    when a placeholder run is empty, leaves the prompt or overlaps another."""
    try:
        images = tuple(
            ImageRef(
                content_hash=pb.content_hash,
                offset=pb.offset,
                length=pb.length,
                grid=tuple(pb.grid),
                media_endpoint=pb.media_endpoint,
            )
            for pb in pbs
        )
        check_images(images, num_prompt_tokens)
    except ValueError as e:
        raise ValidationError(field, str(e)) from None
    for i, im in enumerate(images):
        if len(im.content_hash) != 64:
            raise ValidationError(f"{field}[{i}].content_hash", "must be 64 hex digits")
    return images
