"""The engine core every worker role runs: requests in, per-step token diffs out.

    engine = LLMEngine.from_config(EngineConfig())
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():       # RequestOutput diffs: new tokens, finish reason
            ...

`n > 1` fans out into n sequences (ids `rid#0`..). The first computes the prompt; the others
are admitted once its full prompt blocks are in the prefix cache, so they share those blocks
and recompute at most the last partial block. Seeded requests give completion i the seed
`seed + i`.

The engine works in token ids; stop strings need text, so the caller that detokenizes (the
offline `LLM` API, or the tokenizer service in the fleet) calls `stop_request` when one
matches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmfleet.services.worker.engine.block_manager import BlockManager
from llmfleet.services.worker.engine.model_runner import ModelRunner, kv_bytes_per_block
from llmfleet.services.worker.engine.request import Request, RequestStatus
from llmfleet.services.worker.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from llmfleet.services.worker.engine.sampling_params import SamplingLimits, SamplingParams
from llmfleet.services.worker.engine.scheduler import Scheduler
from llmfleet.services.worker.models.loader import LoadedModel, load_model
from llmfleet.shared.block_hash import HashContext
from llmfleet.shared.config import EngineConfig
from llmfleet.shared.errors import CapacityError, ValidationError

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one sequence (a diff: only the new tokens)."""

    request_id: str  # the client's request id
    index: int  # which of the n completions
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # stop token id or stop string, when one ended it
    num_prompt_tokens: int
    num_cached_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model = loaded.model
        self.info = loaded.info
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(config.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.max_model_len = min(
            config.max_model_len or self.info.max_model_len, self.info.max_model_len
        )
        num_blocks = config.num_kv_blocks or max(
            1,
            config.kv_cache_bytes
            // kv_bytes_per_block(self.info, config.block_size, config.torch_dtype),
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(
            self.model,
            self.info,
            self.block_manager,
            dtype=config.torch_dtype,
            device=self.device,
        )
        self.sampler = Sampler()
        self.limits = SamplingLimits(max_n=config.max_n, max_logprobs=config.max_logprobs)
        self._requests: dict[str, Request] = {}  # by sequence id
        self._groups: dict[str, list[Request]] = {}  # by client request id
        self._deferred: dict[str, list[Request]] = {}  # leader seq id -> siblings to admit
        self._pending_outputs: list[RequestOutput] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        loaded = load_model(config.model, dtype=config.torch_dtype, device=config.device)
        return cls(config, loaded)

    # ---- admission -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
    ) -> None:
        """Validate and queue a request. Raises ValidationError or CapacityError."""
        if not request_id:
            raise ValidationError("request_id", "must not be empty")
        if request_id in self._groups:
            raise ValidationError("request_id", f"{request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValidationError("prompt", "must not be empty")
        vocab = self.info.vocab_size
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
        needed = self.block_manager.blocks_needed(len(prompt_token_ids) + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise CapacityError(
                f"request needs {needed} KV blocks but the cache has "
                f"{self.block_manager.num_blocks}"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.info.eos_token_ids)
        context = HashContext(model_id=self.info.model_id, cache_salt=cache_salt)
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
                )
            )
        self._groups[request_id] = seqs
        for s in seqs:
            self._requests[s.request_id] = s
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            if self.config.enable_prefix_caching:
                self._deferred[seqs[0].request_id] = seqs[1:]
            else:
                for s in seqs[1:]:
                    self.scheduler.add(s)

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of a client request; False if it is unknown or already done."""
        seqs = self._groups.get(request_id)
        if not seqs:
            return False
        for s in seqs:
            if not s.is_finished:
                self._finish(s, RequestStatus.FINISHED_ABORTED)
        return True

    def stop_request(self, seq_id: str, stop_reason: str) -> None:
        """End one sequence because its text matched a stop string."""
        req = self._requests.get(seq_id)
        if req is not None and not req.is_finished:
            req.stop_reason = stop_reason
            self._finish(req, RequestStatus.FINISHED_STOPPED, emit=False)

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.num_unfinished or self._deferred or self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if not sched:
            return outputs
        step = self.runner.execute(sched)
        sampled = None
        if step.sampling_rows:
            rows = []
            for j in step.sampling_rows:
                req = sched.scheduled[j].request
                rows.append(
                    SamplingRow(
                        params=req.params,
                        generator=req.generator,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=req.output_token_ids,
                        stop_token_ids=req.stop_token_ids,
                    )
                )
            sampled = self.sampler(step.logits, rows)
        row_of = {j: r for r, j in enumerate(step.sampling_rows)}
        for j, s in enumerate(sched.scheduled):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if req.index == 0 and req.request_id in self._deferred:
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    for sib in self._deferred.pop(req.request_id):
                        self.scheduler.add(sib)
            if j not in row_of or sampled is None:
                continue
            r = row_of[j]
            token = sampled.token_ids[r]
            req.append_output(token, sampled.logprobs[r])
            status = self._check_finished(req, token)
            if status is not None:
                self._finish(req, status, emit=False)
            outputs.append(self._output(req, [token], [sampled.logprobs[r]]))
        return outputs

    # ---- helpers ---------------------------------------------------------------------------
    def _check_finished(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if token in req.stop_token_ids and req.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, *, emit: bool = True) -> None:
        self.scheduler.finish(req, status)
        deferred = self._deferred.pop(req.request_id, None)
        if deferred:  # the leader ended before its siblings were admitted: admit them now
            for sib in deferred:
                if status is RequestStatus.FINISHED_ABORTED:
                    sib.status = status
                    self._pending_outputs.append(self._output(sib, [], []))
                else:
                    self.scheduler.add(sib)
        if emit:
            self._pending_outputs.append(self._output(req, [], []))
        group = self._groups.get(req.parent_id or req.request_id)
        if group and all(s.is_finished for s in group):
            for s in self._groups.pop(req.parent_id or req.request_id):
                self._requests.pop(s.request_id, None)

    def _output(
        self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> RequestOutput:
        finished = req.is_finished
        return RequestOutput(
            request_id=req.parent_id or req.request_id,
            index=req.index,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
        )

    # ---- stats -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + sum(len(v) for v in self._deferred.values())
