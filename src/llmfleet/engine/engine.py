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

KV hooks for the worker (all synchronous; the caller runs them between steps, never while
`step` runs on another thread):
  - `read_blocks` / `import_cached_blocks`: KV of blocks as a CPU payload
    (nb, num_layers, 2, block_size, num_kv_heads, head_dim), and the reverse: payload blocks
    registered as unreferenced prefix-cache content, which a later request then hits;
  - prefill-only requests (`add_request(prefill_only=True)`): they leave the engine after
    their first token (output `finished` with `finish_reason` None unless the token ended the
    sequence) but keep their blocks pinned, so the worker can read them, until
    `release_pinned` (or `abort`);
  - reservations (lease side): `reserve` holds fresh blocks under an owner id (the lease id),
    `write_reserved` fills them, `start_decode` turns them into a running sequence whose
    prompt is computed and whose first token is appended, `release_reserved` frees them.
Every path that ends a request, pin or reservation returns its blocks: after all of them end,
`num_free_blocks` is back at its idle value.

Async scheduling (`async_scheduling`, with CUDA graphs). A synchronous decode step leaves the
GPU idle while the host reads the tokens back and prepares the next step. Instead, a decode
step of every running sequence keeps its sampled tokens on the device and returns; the next
`step` first launches the step after it (each sequence decodes its pending token at the slot
after its last known token, the token copied into the graph's input on the device), then
reads the pending tokens back and emits them while that step runs. Tokens therefore come out
one `step` call after the step that sampled them, at the GPU's pace. Chaining stops (the
pending tokens are read first, then an ordinary step is scheduled) whenever the next step
needs the host to know them: a request waiting to be admitted, a running sequence not in the
step, a sampling row that is not device-only (penalties, logprobs, an active min_tokens), a
block short, a batch the graphs do not fit, a prefill-only request. A sequence that the
pending token finishes (a stop token) had one more step launched: its token is dropped and
its blocks freed (the device writes that step's KV into them before any later use, in stream
order). Kernels, KV hooks and aborts between steps all queue behind the step in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.flops import (
    StepBatch,
    StepCost,
    estimate_step_cost,
    model_shape,
)
from llmfleet.engine.model_runner import ModelRunner, kv_bytes_per_block
from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.sampler import (
    Sampler,
    SamplingRow,
    device_only,
    small_tensor,
)
from llmfleet.engine.scheduler import Scheduler
from llmfleet.models.loader import LoadedModel, load_model
from llmfleet.shared.core.block_hash import HashContext
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import CapacityError, ValidationError
from llmfleet.shared.core.model_info import ModelInfo
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.sampling_params import SamplingLimits, SamplingParams

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
    num_output_tokens: int = 0  # tokens generated so far, these included


class _InFlight:
    """A decode step launched whose sampled tokens are still on the device; their copy to
    the host is queued right behind the step, so reading them back waits for this step
    alone (`.tolist()` on the device tensor would wait for everything queued after it too,
    the next step included)."""

    def __init__(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        self.requests = requests  # row i's sequence
        self.token_ids = token_ids  # (n,) int64 on the device
        self._copied: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = token_ids

    def read(self) -> list[int]:
        """The tokens on the host, once this step's copy has run."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model = loaded.model
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(config.device)
        if self.spec.dtype != config.torch_dtype:  # the KV cache is made in the config's dtype
            raise ValidationError(
                "dtype",
                f"the model was loaded in {self.spec.dtype}, the engine is configured for "
                f"{config.dtype}",
            )
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_model_len, self.spec.max_model_len
        )
        num_blocks = config.num_kv_blocks or max(
            1,
            config.kv_cache_bytes
            // kv_bytes_per_block(self.spec, config.block_size, config.torch_dtype),
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
            self.spec,
            self.block_manager,
            dtype=config.torch_dtype,
            device=self.device,
        )
        graph_batch = min(config.cuda_graph_max_batch_size, config.max_num_seqs)
        if self.device.type == "cuda" and graph_batch > 0:
            self.runner.capture_decode_graphs(graph_batch, self.max_model_len)
        self.sampler = Sampler()
        self.model_shape = model_shape(self.model, self.kv_dtype.itemsize)
        self.last_step_cost = StepCost()  # of the latest step (zero: it ran no batch)
        self.limits = SamplingLimits(max_n=config.max_n, max_logprobs=config.max_logprobs)
        self._requests: dict[str, Request] = {}  # by sequence id
        self._groups: dict[str, list[Request]] = {}  # by client request id
        self._deferred: dict[str, list[Request]] = {}  # leader seq id -> siblings to admit
        self._pending_outputs: list[RequestOutput] = []
        self._pinned: dict[str, Request] = {}  # prefill-only requests done, blocks held
        self._reserved: dict[str, int] = {}  # reservation owner (lease id) -> blocks held
        self._inflight: _InFlight | None = None  # a decode step launched, tokens not read
        self.num_chained_steps = 0  # decode steps launched before their inputs were read back

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        loaded = load_model(
            config.model,
            dtype=config.torch_dtype,
            device=config.device,
            quantization=config.quantization,
        )
        return cls(config, loaded)

    # ---- admission -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str = "",
        prefill_only: bool = False,
    ) -> None:
        """Validate and queue a request. Raises ValidationError or CapacityError.

        `prefill_only` (n must be 1): the request stops after its first token and keeps its
        blocks pinned until `release_pinned` (see the module docstring).
        """
        self.validate_request(request_id, prompt_token_ids, params)
        if prefill_only and params.n != 1:
            raise ValidationError("sampling.n", "must be 1 for a prefill")
        seqs = self._make_sequences(request_id, prompt_token_ids, params, cache_salt)
        for s in seqs:
            s.prefill_only = prefill_only
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

    def validate_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Every check `add_request` makes; raises ValidationError or CapacityError."""
        if not request_id:
            raise ValidationError("request_id", "must not be empty")
        if request_id in self._groups or request_id in self.block_manager.req_blocks:
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
        needed = self.block_manager.blocks_needed(len(prompt_token_ids) + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise CapacityError(
                f"request needs {needed} KV blocks but the cache has "
                f"{self.block_manager.num_blocks}"
            )

    def _make_sequences(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str,
    ) -> list[Request]:
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
                )
            )
        return seqs

    def abort(self, request_id: str) -> bool:
        """Abort every sequence of a client request; False if it is unknown or already done.

        A prefill-only request that is done but pinned is released."""
        if self.release_pinned(request_id):
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
            return request_id in self._pinned and self.release_pinned(request_id)
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
        return [*self._groups, *self._pinned]

    def has_request(self, request_id: str) -> bool:
        """True while some sequence of the request is unfinished."""
        return request_id in self._groups

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(
            self.scheduler.num_unfinished
            or self._deferred
            or self._pending_outputs
            or self._inflight is not None
        )

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            # Queue the next decode step behind the one in flight, from its tokens on the
            # device, and read those tokens back while the device computes it.
            self._inflight = self._launch_chained(inflight)
            outputs += self._read_back(inflight)
            if self._inflight is not None:
                for req in self._inflight.requests:  # their newest token is known now
                    self.block_manager.cache_full_blocks(req)
                return outputs
        sched = self.scheduler.schedule()
        if not sched:
            self.last_step_cost = StepCost()
            return outputs
        step = self.runner.execute(sched)  # on a GPU: queued, still running
        # Host work from here to the sampler overlaps the device's (the batch is read before
        # the bookkeeping below advances the requests).
        self.last_step_cost = estimate_step_cost(self.model_shape, StepBatch.of(sched))
        # Bookkeeping that needs no sampled token runs while the device computes.
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if req.index == 0 and req.request_id in self._deferred:
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    for sib in self._deferred.pop(req.request_id):
                        self.scheduler.add(sib)
        if not step.sampling_rows:
            return outputs
        reqs = [sched.scheduled[j].request for j in step.sampling_rows]
        rows = [self._sampling_row(req) for req in reqs]
        if step.replayed and len(reqs) == len(sched.scheduled) and self._may_chain(reqs):
            # A decode step of every running sequence: leave its tokens on the device; the
            # next call launches the step after it first (see "Async scheduling" above).
            self._inflight = _InFlight(reqs, self.sampler.sample_ids(step.logits, rows))
            return outputs
        sampled = self.sampler(step.logits, rows)  # waits for the device
        return outputs + self._append_tokens(reqs, sampled.token_ids, sampled.logprobs)

    # ---- async scheduling ------------------------------------------------------------------
    def _may_chain(self, reqs: list[Request]) -> bool:
        """Whether the step after a decode step of `reqs` can be launched before that step's
        tokens are read: graphs to replay, nothing waiting to be admitted, `reqs` all the
        running sequences, each sampling on the device alone (checked at its known output
        length, which is conservative for min_tokens: one token may still be pending)."""
        if not self.config.async_scheduling or self.runner.decode_graphs is None:
            return False
        if self.scheduler.waiting or self._deferred:
            return False
        if len(reqs) != len(self.scheduler.running) or set(reqs) != set(self.scheduler.running):
            return False
        return all(
            not r.prefill_only
            and device_only(r.params, r.num_output_tokens, bool(r.stop_token_ids))
            for r in reqs
        )

    def _launch_chained(self, prev: _InFlight) -> _InFlight | None:
        """Launch the decode step after `prev` for its sequences that go on, each decoding its
        token of `prev` (on the device) at the slot after its last known token; None when
        the step needs the host to know those tokens first (then the caller reads them and
        runs an ordinary step)."""
        live = [i for i, r in enumerate(prev.requests) if r.status is RequestStatus.RUNNING]
        if not live or not self._may_chain([prev.requests[i] for i in live]):
            return None
        # A sequence whose pending token is its last (length limits) has no next step.
        keep = [
            i
            for i in live
            if prev.requests[i].num_output_tokens + 1 < prev.requests[i].params.max_tokens
            and prev.requests[i].num_tokens + 1 < self.max_model_len
        ]
        reqs = [prev.requests[i] for i in keep]
        if not reqs:
            return None
        for req in reqs:  # the slot of the pending token; nothing is preempted here
            if not self.block_manager.allocate_slots(req, req.num_tokens + 1):
                return None
        token_ids = prev.token_ids
        if len(keep) != len(prev.requests):
            token_ids = token_ids.index_select(0, small_tensor(keep, token_ids.device))
        step = self.runner.execute_chained(reqs, token_ids)
        if step is None:
            return None
        self.num_chained_steps += 1
        n = len(reqs)
        batch = StepBatch((1,) * n, tuple(r.num_tokens for r in reqs), n)
        self.last_step_cost = estimate_step_cost(self.model_shape, batch)
        for req in reqs:
            req.num_computed_tokens += 1  # the pending token, appended when read back
        rows = [self._sampling_row(req) for req in reqs]
        return _InFlight(reqs, self.sampler.sample_ids(step.logits, rows))

    def _read_back(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a step's tokens (the host copy waits for the device) and append them."""
        return self._append_tokens(step.requests, step.read())

    def _sampling_row(self, req: Request) -> SamplingRow:
        return SamplingRow(
            params=req.params,
            generator=req.generator,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            stop_token_ids=req.stop_token_ids,
        )

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
            status = self._check_finished(req, token)
            if status is None and req.prefill_only:
                status = RequestStatus.PREFILLED
            if status is not None:
                self._finish(req, status, emit=False)
            outputs.append(self._output(req, [token], [lp]))
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
        pin = req.prefill_only and status is not RequestStatus.FINISHED_ABORTED
        self.scheduler.finish(req, status, free_blocks=not pin)
        if pin:
            self._pinned[req.request_id] = req
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
            finish_reason=(
                req.status.value if finished and req.status is not RequestStatus.PREFILLED else None
            ),
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_output_tokens=req.num_output_tokens,
        )

    # ---- KV hooks (see the module docstring) ------------------------------------------------
    @property
    def kv_block_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim): one block's payload."""
        return self.runner.block_shape

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_caches[0].dtype

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """KV of these blocks as a CPU tensor (nb, num_layers, 2, block_size, Hkv, head_dim)."""
        return self.runner.read_blocks(block_ids)

    def read_cached_blocks(self, block_hashes: list[bytes]) -> torch.Tensor | None:
        """KV of the cached blocks with these hashes; None if any of them is not cached."""
        ids = self.block_manager.cached_block_ids(block_hashes)
        return None if ids is None else self.runner.read_blocks(ids)

    def num_cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        return self.block_manager.num_cached_prefix(block_hashes)

    def import_cached_blocks(self, block_hashes: list[bytes], payload: torch.Tensor) -> int:
        """Register payload blocks as prefix-cache content (unreferenced); how many were new.

        `payload[i]` is the KV of `block_hashes[i]`. Hashes already cached are skipped; when
        free blocks run short, the rest is not imported.
        """
        if payload.shape[0] != len(block_hashes):
            raise ValueError(f"{payload.shape[0]} payload blocks for {len(block_hashes)} hashes")
        if tuple(payload.shape[1:]) != self.kv_block_shape:
            raise ValueError(f"payload block shape {tuple(payload.shape[1:])} is not ours")
        placed = self.block_manager.import_blocks(block_hashes)
        if placed:
            rows = torch.tensor([i for i, _ in placed], dtype=torch.long)
            self.runner.write_blocks([b for _, b in placed], payload.index_select(0, rows))
        return len(placed)

    def pinned_block_ids(self, request_id: str) -> list[int]:
        """The blocks of a done prefill-only request, in block-table order."""
        if request_id not in self._pinned:
            raise KeyError(request_id)
        return list(self.block_manager.block_ids(request_id))

    def release_pinned(self, request_id: str) -> bool:
        req = self._pinned.pop(request_id, None)
        if req is None:
            return False
        self.block_manager.free(req)
        return True

    def reserve(self, owner: str, num_tokens: int) -> int:
        """Hold blocks for `num_tokens` tokens of KV that will be written in; returns how many.

        Raises CapacityError when the free blocks (including evictable cached ones) are short.
        """
        if num_tokens < 1:
            raise ValidationError("num_prompt_tokens", f"must be >= 1, got {num_tokens}")
        if num_tokens >= self.max_model_len:
            raise ValidationError(
                "num_prompt_tokens",
                f"{num_tokens} tokens leave no room to generate within the context length "
                f"{self.max_model_len}",
            )
        num_blocks = self.block_manager.blocks_needed(num_tokens)
        if self.block_manager.allocate_owned(owner, num_blocks) is None:
            raise CapacityError(
                f"{num_blocks} KV blocks needed, {self.block_manager.num_free_blocks} free"
            )
        self._reserved[owner] = num_blocks
        return num_blocks

    def write_reserved(self, owner: str, first_block: int, payload: torch.Tensor) -> None:
        """Copy payload blocks into a reservation's blocks [first_block, first_block + nb)."""
        num_blocks = self._reserved.get(owner)
        if num_blocks is None:
            raise KeyError(owner)
        nb = payload.shape[0]
        if first_block < 0 or first_block + nb > num_blocks:
            raise ValueError(
                f"blocks [{first_block}, {first_block + nb}) outside the {num_blocks} reserved"
            )
        ids = self.block_manager.block_ids(owner)[first_block : first_block + nb]
        self.runner.write_blocks(ids, payload)

    def release_reserved(self, owner: str) -> bool:
        if self._reserved.pop(owner, None) is None:
            return False
        self.block_manager.free_owner(owner)
        return True

    def start_decode(
        self,
        owner: str,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        cache_salt: str = "",
    ) -> None:
        """Turn reservation `owner` into a running request whose prompt KV is in its blocks.

        The request starts with num_computed_tokens = prompt length and `first_token_id`
        appended (it is not emitted again); its full prompt blocks enter the prefix cache. A
        seeded request's generator is advanced past the first token's draw, so its tokens equal
        those of a run that sampled the first token here.
        """
        num_blocks = self._reserved.get(owner)
        if num_blocks is None:
            raise KeyError(owner)
        self.validate_request(request_id, prompt_token_ids, params)
        if params.n != 1:
            raise ValidationError("sampling.n", "must be 1 for a disaggregated request")
        if self.block_manager.blocks_needed(len(prompt_token_ids)) != num_blocks:
            raise ValidationError(
                "prompt_token_ids",
                f"{len(prompt_token_ids)} tokens do not fill the {num_blocks} reserved blocks",
            )
        if not 0 <= first_token_id < self.spec.vocab_size:
            raise ValidationError("first_token_id", f"{first_token_id} is outside the vocabulary")
        [req] = self._make_sequences(request_id, prompt_token_ids, params, cache_salt)
        if req.generator is not None and not params.greedy:
            # The sampler drew V exponentials from it for the first token (see sampler.py).
            torch.empty(self.spec.vocab_size, device=self.device).exponential_(
                generator=req.generator
            )
        del self._reserved[owner]
        self.block_manager.transfer_owner(owner, request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = 0
        req.append_output(first_token_id, None)
        self.block_manager.cache_full_blocks(req)
        self._groups[request_id] = [req]
        self._requests[request_id] = req
        self.scheduler.add_running(req)
        status = self._check_finished(req, first_token_id)
        if status is not None:
            self._finish(req, status)

    def drain_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) prefix-cache hashes since the last call (enables recording)."""
        self.block_manager.record_events = True
        return self.block_manager.drain_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.block_manager.cached_hashes()

    # ---- stats -----------------------------------------------------------------------------
    @property
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

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(self._reserved.values())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + sum(len(v) for v in self._deferred.values())
