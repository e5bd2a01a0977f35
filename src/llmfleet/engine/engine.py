"""The engine core every worker role runs: requests in, per-step token diffs out.

    engine = LLMEngine.from_config(EngineConfig())
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():       # RequestOutput diffs: new tokens, finish reason
            ...
    engine.close()                      # a tensor-parallel engine's other ranks exit

`n > 1` fans out into n sequences (`rid#0`..; intake.py, with every check of a request); the
others join once the first's full prompt blocks are cached, and share them. In token ids: the
detokenizing caller (`LLM`, the fleet's router) calls `stop_request`.

Prefill-only requests (`add_request(prefill_only=True)`, for the worker's prefill side) leave
the engine after their first token (output `finished` with `finish_reason` None unless the
token ended the sequence) but keep their blocks pinned in `engine.kv` (kv_handoff.py), where
the worker reads them, until released there or by `abort`. `start_decode` admits a request
whose prompt KV was written into a reservation of `engine.kv`. Invariant: every path that ends
a request, pin or reservation returns its blocks.

With `async_scheduling` a decode step may leave its tokens on the device; `step` returns them
one call later (`engine.chain`, async_scheduling.py). `last_step_cost` / `last_step_work`:
the latest step's. Images of a prompt (vision-language models): `engine.mm` (mm_inputs.py).
Speculative decoding (`config.speculative`): `engine.speculator` drafts before each step and
verifies after it (spec_decode/speculator.py; a step's diff may then carry several tokens).

Who mutates what: the scheduler moves requests between its queues (admit, preempt, finish);
the engine advances `num_computed_tokens` by what each step computed (`engine.chain` for the
steps it launches, `engine.speculator` for the drafts a step kept), and alone appends tokens
and ends requests; pins and reservations change only through `engine.kv`.
"""

from __future__ import annotations

from llmfleet.engine import flops
from llmfleet.engine.async_scheduling import DecodeChain, InFlight
from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.flops import ModelShape, StepCost
from llmfleet.engine.forward_pass import forward_pass, kv_cache_blocks, load_for, prepare_device
from llmfleet.engine.intake import RequestIntake
from llmfleet.engine.kv_handoff import KVHandoff
from llmfleet.engine.mm_inputs import MultimodalInputs
from llmfleet.engine.pooling import Pooler
from llmfleet.engine.request import Request, RequestOutput, RequestStatus
from llmfleet.engine.sampler import SamplingRow
from llmfleet.engine.scheduler import Scheduler
from llmfleet.engine.spec_decode import make_proposer
from llmfleet.engine.spec_decode.speculator import SpecStats, Speculator
from llmfleet.engine.structured import GrammarCache, MaskFiller, grammar_status, start_mask
from llmfleet.models.loader import LoadedModel
from llmfleet.models.simulated import SimulatedModel
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.multimodal import ImageRef, PixelInput
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.sampling_params import SamplingLimits, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        config = config.resolved()
        self.config = config
        self.model = loaded.model
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.device = prepare_device(config, self.spec)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_model_len, self.spec.max_model_len
        )
        self.simulated = isinstance(self.model, SimulatedModel)
        self.model_shape: ModelShape | None = None  # for work estimates; None when simulated
        if not isinstance(self.model, SimulatedModel):
            self.model_shape = flops.model_shape(self.model, config.torch_dtype.itemsize)
        # The proposer first: a draft model's weights and cache count as held when the
        # engine's own KV cache is sized from what is left (spec_decode/draft_kv.py).
        proposer = make_proposer(config.speculative, loaded, config) if config.speculative else None
        num_blocks = kv_cache_blocks(config, loaded, self.model_shape, self.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.runner, self.sampler = forward_pass(
            config, loaded, self.block_manager, self.device, self.max_model_len
        )
        self.kv = KVHandoff(self.block_manager, self.runner, self.max_model_len)
        self.mm: MultimodalInputs = self.runner.mm  # images: encoder cache and runs
        self.masks = MaskFiller(self.spec.vocab_size, self.device)  # structured output
        self.chain = DecodeChain(
            self.runner,
            self.scheduler,
            self.block_manager,
            self.sampler,
            self.model_shape,
            enabled=config.async_scheduling,
            max_model_len=self.max_model_len,
            masks=self.masks,
        )
        self.last_step_cost = StepCost()  # of the latest step (zero: it ran no batch)
        self.last_step_work = (0, 0)  # (prompt tokens, decoded sequences) of the latest step
        self.limits = SamplingLimits(max_n=config.max_n, max_logprobs=config.max_logprobs)
        self.intake = RequestIntake(
            self.spec,
            self.limits,
            self.block_manager,
            max_model_len=self.max_model_len,
            device=self.device,
            grammars=GrammarCache.of(loaded),
            mm=self.mm,
        )
        self.pooler = Pooler.for_engine(self)  # embeddings (pooling.py)
        self.speculator = Speculator.for_engine(self, proposer)  # None: no speculation
        self.spec_stats = self.speculator.stats if self.speculator else SpecStats()
        self._requests: dict[str, Request] = {}  # by sequence id
        self._groups: dict[str, list[Request]] = {}  # by client request id
        self._deferred: dict[str, list[Request]] = {}  # leader seq id -> siblings to admit
        self._pending_outputs: list[RequestOutput] = []
        self._inflight: InFlight | None = None  # a decode step launched, tokens not read

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config, load_for(config))

    def close(self) -> None:
        """Stop the ranks the forward pass runs on (tensor parallelism); no steps after it."""
        self.masks.close()
        self.runner.close()

    # ---- admission -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
        prefill_only: bool = False,
        num_replayed_tokens: int = 0,
        images: tuple[ImageRef, ...] = (),
        pixels: dict[str, PixelInput] | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValidationError or CapacityError.

        `images`: the prompt's; `pixels`: those the encoder cache lacks (mm_inputs.py).
        `prefill_only` (n must be 1): the request stops after its first token and keeps its
        blocks pinned until `kv.release_pinned` (see the module docstring).
        `num_replayed_tokens`: the prompt's last tokens are output generated elsewhere (a
        migration), which a structured-output matcher accepts first.
        """
        pixels, replayed = pixels or {}, num_replayed_tokens
        self.validate_request(request_id, prompt_token_ids, params, replayed)
        self.intake.check_images(prompt_token_ids, images, pixels)
        if prefill_only and params.n != 1:
            raise ValidationError("sampling.n", "must be 1 for a prefill")
        seqs = self.intake.sequences(
            request_id, prompt_token_ids, params, cache_salt, replayed, images, pixels
        )
        for s in seqs:
            s.prefill_only = prefill_only
        self._groups[request_id] = seqs
        self._requests.update((s.request_id, s) for s in seqs)
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            if self.config.enable_prefix_caching:
                self._deferred[seqs[0].request_id] = seqs[1:]
            else:
                for s in seqs[1:]:
                    self.scheduler.add(s)

    def validate_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, replayed=0
    ) -> None:
        """Every check `add_request` makes but its images'; raises ValidationError or
        CapacityError."""
        in_use = request_id in self._groups or request_id in self.block_manager.req_blocks
        self.intake.check(request_id, prompt_token_ids, params, in_use=in_use, replayed=replayed)

    def start_decode(
        self,
        owner: str,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        cache_salt: str = "",
        images: tuple[ImageRef, ...] = (),
    ) -> None:
        """Turn reservation `owner` (in `kv`) into a running request whose prompt KV is in its
        blocks; KeyError when `owner` holds none. `images`: the prompt's (no pixels needed).

        The request starts with num_computed_tokens = prompt length and `first_token_id`
        appended (it is not emitted again); its full prompt blocks enter the prefix cache. A
        seeded request's generator is advanced past the first token's draw, so its tokens equal
        those of a run that sampled the first token here.
        """
        num_blocks = self.kv.reserved_blocks(owner)
        self.validate_request(request_id, prompt_token_ids, params)
        self.intake.check_images(prompt_token_ids, images, None)
        req = self.intake.prefilled(
            request_id, prompt_token_ids, first_token_id, params, cache_salt, num_blocks, images
        )
        self.kv.hand_over(owner, request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = 0
        req.append_output(first_token_id, None)
        self.block_manager.cache_full_blocks(req)
        self._groups[request_id] = [req]
        self._requests[request_id] = req
        self.scheduler.add_running(req)
        status = grammar_status(req, accepted=True)
        status = status or self.intake.finish_status(req, first_token_id)
        if status is not None:
            self._finish(req, status)

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of a client request; False if it is unknown or already done.

        A prefill-only request that is done but pinned is released."""
        if self.kv.release_pinned(request_id):
            return True
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

    def cancel(
        self, request_id: str, index: int | None = None, stop_string: str | None = None
    ) -> bool:
        """Abort (or, with `stop_string`, stop) one completion or all of them.

        Aborted sequences emit a final output (finish reason "abort"); stopped ones do not,
        since the caller that matched the stop string already ended the completion upstream.
        False when the request (or that completion) is not running here.
        """
        if index is None and stop_string is None:
            return self.abort(request_id)
        seqs = self._groups.get(request_id)
        if not seqs:
            return self.kv.release_pinned(request_id)
        targets = seqs if index is None else [s for s in seqs if s.index == index]
        live = [s for s in targets if not s.is_finished]
        for s in live:
            if stop_string is None:
                self._finish(s, RequestStatus.FINISHED_ABORTED)
            else:
                self.stop_request(s.request_id, stop_string)
        return bool(live)

    def request_ids(self) -> list[str]:
        """Client request ids with unfinished sequences, and done-but-pinned prefills."""
        return [*self._groups, *self.kv.pinned_request_ids()]

    def has_request(self, request_id: str) -> bool:
        """True while some sequence of the request is unfinished."""
        return request_id in self._groups

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        pending = self._deferred or self._pending_outputs or self._inflight is not None
        return bool(self.scheduler.num_unfinished or pending)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            # Queue the next decode step behind the one in flight, from its tokens on the
            # device, and read those tokens back while the device computes it.
            chained = self.chain.launch(inflight, waiting=self.num_waiting > 0)
            if chained is not None:
                self._inflight, self.last_step_cost = chained
                self.last_step_work = (0, len(self._inflight.requests))
            outputs += self._append_tokens(inflight.requests, inflight.read())
            if self._inflight is not None:
                for req in self._inflight.requests:  # their newest token is known now
                    self.block_manager.cache_full_blocks(req)
                return outputs
        sched = (self.speculator or self.scheduler).schedule()  # drafts first, if speculating
        for req in self.mm.drop_lacking(sched):  # its images are no longer at hand
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        if not sched:
            self.last_step_cost, self.last_step_work = StepCost(), (0, 0)
            return outputs
        mask = start_mask(self.masks, sched)  # filled on a thread while the forward pass runs
        step = self.runner.execute(sched)  # on a GPU: queued, still running
        self.pooler.collect(sched, self.runner.last_hidden)  # embeddings end here
        # Host work from here to the sampler overlaps the device's (the batch is read before
        # the bookkeeping below advances the requests).
        if self.model_shape is not None:
            self.last_step_cost = flops.estimate_step_cost(
                self.model_shape, flops.StepBatch.of(sched)
            )
        self.last_step_work = flops.step_work(sched)
        # Bookkeeping that needs no sampled token runs while the device computes.
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            self.block_manager.cache_full_blocks(req)
            if req.index == 0 and req.request_id in self._deferred:
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    for sib in self._deferred.pop(req.request_id):
                        self.scheduler.add(sib)
        if self.speculator is not None and self.speculator.handles(sched):  # drafts to verify
            return outputs + self.speculator.complete(sched, step, mask, self._append_tokens)
        if not step.sampling_rows:
            return outputs
        reqs = [sched.scheduled[j].request for j in step.sampling_rows]
        if mask is not None:
            self.masks.apply(mask, step.logits)
        rows = [SamplingRow.of(req) for req in reqs]
        every_row = step.replayed and len(reqs) == len(sched.scheduled)
        if every_row and self.chain.may_chain(reqs, waiting=self.num_waiting > 0):
            # A decode step of every running sequence: leave its tokens on the device; the
            # next call launches the step after it first (async_scheduling.py).
            self._inflight = InFlight(reqs, self.sampler.sample_ids(step.logits, rows))
            return outputs
        sampled = self.sampler(step.logits, rows)  # waits for the device
        return outputs + self._append_tokens(reqs, sampled.token_ids, sampled.logprobs)

    def _append_tokens(
        self,
        reqs: list[Request],
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> list[RequestOutput]:
        """Append each request's sampled token and end the requests it finishes. A request
        that ended meanwhile (aborted, or finished before a step launched ahead) drops its."""
        outputs = []
        for r, (req, token) in enumerate(zip(reqs, token_ids, strict=True)):
            if req.is_finished:
                continue
            lp = logprobs[r] if logprobs is not None else None
            req.append_output(token, lp)
            status = grammar_status(req) or self.intake.finish_status(req, token)
            if status is None and req.prefill_only:
                status = RequestStatus.PREFILLED
            if status is not None:
                self._finish(req, status, emit=False)
            outputs.append(RequestOutput.of(req, [token], [lp]))
        return outputs

    # ---- finishing -------------------------------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus, *, emit: bool = True) -> None:
        pin = req.prefill_only and status is not RequestStatus.FINISHED_ABORTED
        self.scheduler.finish(req, status, free_blocks=not pin)
        self.mm.release(req)
        if self.speculator is not None:
            self.speculator.release(req)
        if pin:
            self.kv.pin(req)
        deferred = self._deferred.pop(req.request_id, None)
        if deferred:  # the leader ended before its siblings were admitted: admit them now
            for sib in deferred:
                if status is RequestStatus.FINISHED_ABORTED:
                    sib.status = status
                    self._pending_outputs.append(RequestOutput.of(sib, [], []))
                else:
                    self.scheduler.add(sib)
        if emit:
            self._pending_outputs.append(RequestOutput.of(req, [], []))
        group = self._groups.get(req.parent_id or req.request_id)
        if group and all(s.is_finished for s in group):
            for s in self._groups.pop(req.parent_id or req.request_id):
                self._requests.pop(s.request_id, None)

    # ---- stats -----------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        """The served model as the API reports it (intake.py)."""
        return self.intake.model_info()

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + sum(len(v) for v in self._deferred.values())
