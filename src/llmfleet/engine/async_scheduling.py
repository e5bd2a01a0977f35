"""Async scheduling: decode steps chained on the device, ahead of reading their tokens back.

A synchronous decode step leaves the GPU idle while the host reads the tokens back and prepares
the next step. With `async_scheduling` (and CUDA graphs to replay), a decode step of every
running sequence keeps its sampled tokens on the device (`InFlight`) and `LLMEngine.step`
returns; the next `step` first has `DecodeChain.launch` queue the step after it (each sequence
decodes its pending token at the slot after its last known token, the token copied into the
graph's input on the device), then reads the pending tokens back and emits them while that
step runs. Tokens therefore come out one `step` call after the step that sampled them, at the
GPU's pace. A structured-output row chains too: once the step is queued, the host reads the
pending tokens, the matchers accept them and the step's grammar mask is filled and applied
before it samples, all while the device runs the forward pass (structured.py).

Chaining stops (the pending tokens are read first, then an ordinary step is scheduled)
whenever the next step needs the host to know them: a request waiting to be admitted, a running
sequence not in the step, a sampling row that is not device-only (penalties, logprobs, an
active min_tokens), a block short, a batch the graphs do not fit, a prefill-only request, a
batch whose next step could carry speculative drafts (spec_decode/speculator.py). A
sequence that its pending token finishes (a stop token) had one more step launched: the engine
drops the token that step samples and frees the blocks (the device writes that step's KV into
them before any later use, in stream order). Kernels, KV handoff calls and aborts between
steps all queue behind the step in flight.

Who mutates what: `launch` allocates the pending token's slot and advances
`num_computed_tokens` of the sequences it launches; the engine alone appends their tokens
(when it reads an `InFlight` back) and ends requests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.flops import ModelShape, StepBatch, StepCost, estimate_step_cost
from llmfleet.engine.model_runner import ModelRunner
from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.sampler import Sampler, SamplingRow, device_only, small_tensor
from llmfleet.engine.scheduler import Scheduler
from llmfleet.engine.structured import MaskFiller, start_ahead_mask


@functools.cache
def readback_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies sampled tokens to the host (one per device)."""
    return torch.cuda.Stream(device)


class InFlight:
    """A decode step launched whose sampled tokens are still on the device; their copy to
    the host is queued right behind the sampling, so reading them back waits for this step
    alone (`.tolist()` on the device tensor would wait for everything queued after it too,
    the next step included). The copy runs on a side stream (`readback_stream`): the next
    step, queued behind the sampling on the compute stream, does not wait for it."""

    def __init__(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        self.requests = requests  # row i's sequence
        self.token_ids = token_ids  # (n,) int64 on the device
        self._copied: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            side = readback_stream(token_ids.device)
            side.wait_stream(torch.cuda.current_stream(token_ids.device))
            with torch.cuda.stream(side):
                self._host.copy_(token_ids, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(side)
            token_ids.record_stream(side)  # its memory outlives the copy
        else:
            self._host = token_ids

    def read(self) -> list[int]:
        """The tokens on the host, once this step's copy has run."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


class DecodeChain:
    """Decides whether a decode step may be chained, and launches chained steps; the engine
    owns one as `engine.chain` and keeps the step in flight itself."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        block_manager: BlockManager,
        sampler: Sampler,
        model_shape: ModelShape | None,  # None: no work estimate (a simulated model)
        *,
        enabled: bool,
        max_model_len: int,
        masks: MaskFiller | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.sampler = sampler
        self.model_shape = model_shape
        self.enabled = enabled
        self.max_model_len = max_model_len
        self.masks = masks  # structured output: a chained step's grammar masks
        self.num_chained_steps = 0  # decode steps launched before their inputs were read back
        self.speculator: Any = None  # spec_decode's Speculator, when the engine speculates

    def may_chain(self, reqs: list[Request], *, waiting: bool) -> bool:
        """Whether the step after a decode step of `reqs` can be launched before that step's
        tokens are read: graphs to replay, nothing `waiting` to be admitted, `reqs` all the
        running sequences, each sampling on the device alone (checked at its known output
        length, which is conservative for min_tokens: one token may still be pending)."""
        if not self.enabled or self.runner.decode_graphs is None:
            return False
        if waiting or (self.speculator is not None and self.speculator.blocks_chain(reqs)):
            return False
        running = self.scheduler.running
        if len(reqs) != len(running) or set(reqs) != set(running):
            return False
        return all(
            not r.prefill_only
            and device_only(
                r.params,
                r.num_output_tokens,
                bool(r.stop_token_ids),
                masked_ahead=self.masks is not None,
            )
            for r in reqs
        )

    def launch(self, prev: InFlight, *, waiting: bool) -> tuple[InFlight, StepCost] | None:
        """Launch the decode step after `prev` for its sequences that go on, each decoding its
        token of `prev` (on the device) at the slot after its last known token; returns it and
        its estimated cost. None when the step needs the host to know those tokens first (then
        the caller reads them and runs an ordinary step)."""
        live = [i for i, r in enumerate(prev.requests) if r.status is RequestStatus.RUNNING]
        if not live or not self.may_chain([prev.requests[i] for i in live], waiting=waiting):
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
        mask = None
        if self.masks is not None and any(r.matcher is not None for r in reqs):
            # The forward pass is queued: read `prev`'s tokens meanwhile (this waits for
            # `prev` alone) and fill this step's grammar mask from them.
            host = prev.read()
            mask = start_ahead_mask(self.masks, reqs, [host[i] for i in keep])
        self.num_chained_steps += 1
        n = len(reqs)
        batch = StepBatch((1,) * n, tuple(r.num_tokens for r in reqs), n)
        cost = (
            StepCost() if self.model_shape is None else estimate_step_cost(self.model_shape, batch)
        )
        for req in reqs:
            req.num_computed_tokens += 1  # the pending token, appended when read back
        if mask is not None:
            self.masks.apply(mask, step.logits)
        rows = [SamplingRow.of(req) for req in reqs]
        return InFlight(reqs, self.sampler.sample_ids(step.logits, rows)), cost
