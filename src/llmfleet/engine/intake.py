"""Request intake: the checks a request must pass to enter the engine, and the sequences it
becomes.

Policy over the model's spec, the sampling limits and the KV cache's geometry. It holds no
request state and mutates nothing: the engine tells it whether a request id is in use, and
admits the sequences it builds. Errors are typed: `ValidationError` names the parameter,
also when the whole KV cache could never hold the request (no retry would help).

A request with `n > 1` becomes n sequences `rid#0`.. (one sequence `rid` when n == 1), each
with the request's stop ids (plus the model's eos ids unless `ignore_eos`), the hash context of
its prefix-cache blocks (model id, cache salt) and, when seeded, its own generator on the
engine's device seeded `seed + i`, and, with structured output, its own grammar matcher (which
first accepts the prompt's last `num_replayed` tokens: output generated elsewhere before a
migration). A prompt's images are checked and attached (pins, M-RoPE positions) by
mm_inputs.py.
"""

from __future__ import annotations

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.mm_inputs import MultimodalInputs
from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.structured import GrammarCache
from llmfleet.models.loader import ModelSpec
from llmfleet.shared.core.block_hash import HashContext
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import ImageRef, PixelInput
from llmfleet.shared.core.sampling_params import SamplingLimits, SamplingParams


class RequestIntake:
    def __init__(
        self,
        spec: ModelSpec,
        limits: SamplingLimits,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        device: torch.device,
        grammars: GrammarCache | None,  # None: structured output unsupported (simulated)
        mm: MultimodalInputs | None = None,  # images (vision-language models)
    ) -> None:
        self.spec = spec
        self.mm = mm
        self.grammars = grammars
        self.limits = limits
        self.block_manager = block_manager  # read for the cache's geometry only
        self.max_model_len = max_model_len
        self.device = device

    def model_info(self) -> ModelInfo:
        """The served model as the API reports it: the checkpoint's identity, this engine's
        context length and sampling limits."""
        return ModelInfo(
            model_id=self.spec.model_id,
            architecture=self.spec.architecture,
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.spec.eos_token_ids,
            max_n=self.limits.max_n,
            max_logprobs=self.limits.max_logprobs,
            block_size=self.block_manager.block_size,
        )

    def check(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        in_use: bool,
        replayed: int = 0,
    ) -> None:
        """Raises ValidationError or CapacityError; `in_use`: the engine knows the id already;
        `replayed`: trailing prompt tokens that are output generated elsewhere."""
        if not request_id:
            raise ValidationError("request_id", "must not be empty")
        if in_use:
            raise ValidationError("request_id", f"{request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValidationError("prompt", "must not be empty")
        vocab = self.spec.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValidationError(
                    "prompt_token_ids",
                    f"token id {t!r} at position {i} is outside the vocabulary [0, {vocab})",
                )
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValidationError(
                    "stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab})"
                )
        params.check_against(
            self.limits, num_prompt_tokens=len(prompt_token_ids), max_model_len=self.max_model_len
        )
        if not 0 <= replayed < len(prompt_token_ids):
            raise ValidationError(
                "num_replayed_tokens",
                f"must be in [0, {len(prompt_token_ids)}) for this prompt, got {replayed}",
            )
        if params.structured_output is not None:
            if self.grammars is None:
                raise ValidationError(
                    "sampling.structured_output", "not supported by a simulated model"
                )
            self.grammars.compile(params.structured_output)  # a cache hit once compiled
        needed = self.block_manager.blocks_needed(len(prompt_token_ids) + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValidationError(
                "max_tokens",
                f"the prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) need {needed} KV blocks; this worker's whole cache has "
                f"{self.block_manager.num_blocks}",
            )

    def check_prefilled(
        self,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        num_blocks: int,
    ) -> None:
        """What a request whose prompt was computed elsewhere must satisfy beyond `check`: one
        completion, a prompt that fills its reserved blocks, a first token in the vocabulary."""
        if params.n != 1:
            raise ValidationError("sampling.n", "must be 1 for a disaggregated request")
        if self.block_manager.blocks_needed(len(prompt_token_ids)) != num_blocks:
            raise ValidationError(
                "prompt_token_ids",
                f"{len(prompt_token_ids)} tokens do not fill the {num_blocks} reserved blocks",
            )
        if not 0 <= first_token_id < self.spec.vocab_size:
            raise ValidationError("first_token_id", f"{first_token_id} is outside the vocabulary")

    def check_images(
        self,
        prompt_token_ids: list[int],
        images: tuple[ImageRef, ...],
        pixels: dict[str, PixelInput] | None,
    ) -> None:
        """ValidationError naming `images` unless the model takes them and they sit on
        placeholder runs of the prompt; `pixels` None: the prompt's KV is computed elsewhere,
        else mm_inputs.MissingPixels for images neither cached nor in `pixels`."""
        if images and self.mm is None:
            raise ValidationError("images", "the served model takes no images")
        if images and self.mm is not None:
            self.mm.check(prompt_token_ids, images, pixels)

    def sequences(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str,
        num_replayed: int = 0,
        images: tuple[ImageRef, ...] = (),
        pixels: dict[str, PixelInput] | None = None,
    ) -> list[Request]:
        """The sequences of a request that passed `check` (and `check_images`)."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.spec.eos_token_ids)
        context = HashContext(model_id=self.spec.model_id, cache_salt=cache_salt)
        seqs = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed((params.seed + i) % 2**64)
            seqs.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    stop_token_ids=frozenset(stop_ids),
                    block_size=self.block_manager.block_size,
                    hash_context=context,
                    generator=generator,
                    parent_id=request_id,
                    index=i,
                    images=tuple(images),
                )
            )
            if images and self.mm is not None:
                self.mm.attach(seqs[-1], pixels or {})
        if params.structured_output is not None and self.grammars is not None:
            replay = prompt_token_ids[len(prompt_token_ids) - num_replayed :]
            for s in seqs:
                s.matcher = self.grammars.matcher(params.structured_output, replay)
        return seqs

    def prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        cache_salt: str,
        num_blocks: int,
        images: tuple[ImageRef, ...],
    ) -> Request:
        """The sequence of a request whose prompt was computed elsewhere into `num_blocks`
        reserved blocks (`check_prefilled`), its matcher and generator past the first token."""
        self.check_prefilled(prompt_token_ids, first_token_id, params, num_blocks)
        [req] = self.sequences(request_id, prompt_token_ids, params, cache_salt, images=images)
        if req.matcher is not None and not req.matcher.accept(first_token_id):
            if self.mm is not None:
                self.mm.release(req)  # (its pins)
            raise ValidationError("first_token_id", "does not match the structured output")
        self.skip_first_draw(req)
        return req

    def finish_status(self, req: Request, token: int) -> RequestStatus | None:
        """Whether `req`'s newest token `token` ends it: a stop token (past min_tokens),
        max_tokens or the context length."""
        params = req.params
        if token in req.stop_token_ids and req.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def skip_first_draw(self, req: Request) -> None:
        """Advance a seeded sequence's generator past the draw that sampled its first token
        elsewhere, so its later tokens equal those of a run that sampled that token here."""
        if req.generator is not None and not req.params.greedy:
            # The sampler drew V exponentials from it for the first token (see sampler.py).
            torch.empty(self.spec.vocab_size, device=self.device).exponential_(
                generator=req.generator
            )
