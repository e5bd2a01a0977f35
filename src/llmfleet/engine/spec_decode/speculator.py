"""The engine's side of speculative decoding: drafts before a step, verification after it.

Each step (`LLMEngine.step`):
  1. `schedule`: the proposer drafts up to k tokens for each running sequence that may
     speculate (`may_speculate`), capped so the sequence cannot pass max_tokens or the context
     length; the scheduler then gives each draft a budget token and a KV slot, trimming them
     when short (scheduler.py); a preempted sequence's proposer state is released.
  2. the runner computes every sequence's new tokens, drafts after the last known token, and
     returns d + 1 logits rows for a sequence with d drafts (model_runner.py).
  3. `complete`: draft-free rows are sampled by the sampler as without speculation; drafted
     sequences go through rejection sampling (rejection.py). Their kept drafts and the target's
     token are appended one at a time, so a stop token (past min_tokens), max_tokens or the
     context length ends the sequence exactly where decoding without drafts would, and later
     tokens are dropped. `num_computed_tokens` then covers the last known token and the kept
     drafts only: the slots of rejected drafts are rewritten by later steps before anything
     reads them, and the blocks past the sequence's tokens are released (`BlockManager.trim`).
     Block hashes cover appended tokens alone, so no block holding a rejected draft's KV is
     ever registered in the prefix cache. The proposer then observes what each step kept.

A sequence speculates unless it asks for logprobs, penalties or structured output, opts out
(`SamplingParams.speculative is False`), is prefill-only, or more than `disable_batch_size`
sequences run: those behave exactly as without speculation. A decode step with drafts replays
the decode graphs (model_runner.py) but is never chained ahead: the host must know its tokens
first (async_scheduling.py asks `blocks_chain`).

Counters (cumulative): per sequence `Request.num_draft_tokens` / `num_accepted_tokens`, and
`SpecStats` over the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.model_runner import ModelRunner, StepOutput
from llmfleet.engine.request import Request, RequestOutput, RequestStatus
from llmfleet.engine.sampler import Sampler, SamplingRow, select_rows
from llmfleet.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from llmfleet.engine.spec_decode.proposer import Computed, Proposer
from llmfleet.engine.spec_decode.rejection import Verify, rejection_sample
from llmfleet.engine.structured import MaskFiller
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

# Appends one token per (request, token) pair in order, ending requests as they finish.
AppendTokens = Callable[
    [list[Request], list[int], "list[TokenLogprobs | None] | None"], list[RequestOutput]
]


@dataclass
class SpecStats:
    """Engine-wide counters, cumulative."""

    num_steps: int = 0  # steps that verified drafts
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # of which kept
    num_emitted: int = 0  # tokens emitted by drafted sequences (kept drafts + target tokens)
    accepted_by_position: list[int] = field(default_factory=list)  # i: drafts kept at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        masks: MaskFiller | None,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.scheduler = scheduler
        self.bm: BlockManager = scheduler.bm
        self.sampler = sampler
        self.masks = masks
        self.max_model_len = max_model_len
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_by_position=[0] * self.k)
        # A proposer that keeps state from `observe` must see every step: none is chained.
        self.observes = type(proposer).observe is not Proposer.observe
        if proposer.hidden_layers:
            runner.set_capture_layers(proposer.hidden_layers)
        self._draft_probs: dict[str, torch.Tensor] = {}

    @classmethod
    def for_engine(cls, engine: Any, proposer: Proposer | None) -> Speculator | None:
        """The speculator of an `LLMEngine` being built (its scheduler, runner, sampler,
        masks and chain exist) around `proposer` (`make_proposer`'s, built before the engine
        sized its KV cache), or None when its `config.speculative` is unset."""
        config = engine.config
        if config.speculative is None or proposer is None:
            return None
        logger.info(
            "speculative decoding: %s, up to %d draft tokens per step",
            config.speculative.method,
            config.speculative.num_speculative_tokens,
        )
        speculator = cls(
            config.speculative,
            proposer,
            scheduler=engine.scheduler,
            runner=engine.runner,
            sampler=engine.sampler,
            masks=engine.masks,
            max_model_len=engine.max_model_len,
        )
        engine.chain.speculator = speculator
        return speculator

    # ---- before the step ---------------------------------------------------------------------
    def may_speculate(self, req: Request) -> bool:
        """Whether `req`'s parameters allow drafts (the batch size and phase aside)."""
        p = req.params
        return (
            p.speculative is not False
            and not req.prefill_only
            and req.pooling is None
            and req.matcher is None
            and p.structured_output is None
            and p.logprobs is None
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )

    def batch_speculates(self, num_running: int) -> bool:
        limit = self.config.disable_batch_size
        return limit is None or num_running <= limit

    def blocks_chain(self, reqs: Sequence[Request]) -> bool:
        """Whether a decode step of `reqs` must not be chained ahead: the next step could
        carry drafts, or the proposer observes every step."""
        if self.observes:
            return True
        return self.batch_speculates(len(reqs)) and any(self.may_speculate(r) for r in reqs)

    def schedule(self) -> SchedulerOutput:
        """Draft for the running sequences, then schedule the step (see the module docstring)."""
        running = self.scheduler.running
        for req in running:
            req.spec_token_ids = []
        self._draft_probs.clear()
        if running and self.batch_speculates(len(running)):
            self._draft(running)
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self.release(req)
        return sched

    def _draft(self, running: list[Request]) -> None:
        reqs, caps = [], []
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1 or not self.may_speculate(req):
                continue  # mid-prompt, or not speculating
            # Emitting d + 1 tokens must not pass max_tokens; the d drafts need slots in context.
            cap = min(
                self.k,
                req.params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens,
            )
            if cap > 0:
                reqs.append(req)
                caps.append(cap)
        if not reqs:
            return
        drafts = self.proposer.propose(reqs, max(caps))
        probs = self.proposer.last_draft_probs
        self.proposer.last_draft_probs = None
        for i, (req, cap, d) in enumerate(zip(reqs, caps, drafts, strict=True)):
            req.spec_token_ids = list(d[:cap])
            if probs is not None and probs[i] is not None and req.spec_token_ids:
                self._draft_probs[req.request_id] = probs[i]

    def release(self, req: Request) -> None:
        """`req` ended or was preempted: its drafts and the proposer's state go."""
        req.spec_token_ids = []
        self.proposer.release(req.request_id)

    # ---- after the step ----------------------------------------------------------------------
    def handles(self, sched: SchedulerOutput) -> bool:
        """Whether `complete` finishes this step (else the engine samples it as usual)."""
        return self.observes or sched.has_drafts

    def complete(
        self, sched: SchedulerOutput, step: StepOutput, mask: Any, append: AppendTokens
    ) -> list[RequestOutput]:
        """Sample, verify and append the step's tokens (after the engine advanced each
        request's `num_computed_tokens` by its known tokens), then let the proposer observe.
        `mask`: the structured-output mask of the draft-free sampling rows (structured.py)."""
        plain: list[ScheduledRequest] = []
        drafted: list[ScheduledRequest] = []
        plain_rows: list[int] = []
        drafted_rows: list[int] = []
        for row, j in enumerate(step.sampling_rows):  # a sequence's rows are consecutive
            s = sched.scheduled[j]
            group = drafted if s.spec_token_ids else plain
            if not group or group[-1] is not s:
                group.append(s)
            (drafted_rows if s.spec_token_ids else plain_rows).append(row)
        outputs: list[RequestOutput] = []
        if plain:
            logits = step.logits
            if drafted:
                logits = select_rows(logits, plain_rows)
            if mask is not None and self.masks is not None:
                self.masks.apply(mask, logits)
            reqs = [s.request for s in plain]
            sampled = self.sampler(logits, [SamplingRow.of(r) for r in reqs])
            outputs += append(reqs, sampled.token_ids, sampled.logprobs)
        kept: dict[int, int] = {}  # id(scheduled request) -> drafts kept
        if drafted:
            logits = select_rows(step.logits, drafted_rows)
            verify = [
                Verify(
                    SamplingRow.of(s.request),
                    s.spec_token_ids,
                    self._draft_probs.get(s.request.request_id),
                )
                for s in drafted
            ]
            emitted = rejection_sample(logits, verify)
            self.stats.num_steps += 1
            for s, tokens in zip(drafted, emitted, strict=True):
                out = self._append_verified(s, tokens, append)
                if out is not None:
                    outputs.append(out)
                kept[id(s)] = len(tokens) - 1
        self._observe(sched, step, kept)
        return outputs

    def _append_verified(
        self, s: ScheduledRequest, tokens: list[int], append: AppendTokens
    ) -> RequestOutput | None:
        """Append a verified sequence's tokens; its one output of the step (None if it had
        ended before the step's tokens came)."""
        req, d, a = s.request, len(s.spec_token_ids), len(tokens) - 1
        if req.is_finished:
            return None
        req.num_draft_tokens += d
        req.num_accepted_tokens += a
        stats = self.stats
        stats.num_drafted += d
        stats.num_accepted += a
        for i in range(a):
            stats.accepted_by_position[i] += 1
        before = req.num_output_tokens
        outs = append([req] * len(tokens), tokens, None)
        stats.num_emitted += req.num_output_tokens - before
        if not req.is_finished:
            req.num_computed_tokens += a  # the kept drafts' KV stays; the rest is rolled back
            self.bm.trim(req, req.num_tokens)
            self.bm.cache_full_blocks(req)
        out = outs[-1]
        out.new_token_ids = [t for o in outs for t in o.new_token_ids]
        out.new_logprobs = [lp for o in outs for lp in o.new_logprobs]
        return out

    def _observe(self, sched: SchedulerOutput, step: StepOutput, kept: dict[int, int]) -> None:
        if not self.observes:
            return
        computed = []
        for j, s in enumerate(sched.scheduled):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # ended this step: released already
            known = s.num_new_tokens - len(s.spec_token_ids)
            num_kept = known + kept.get(id(s), 0)
            start = req.num_computed_tokens - num_kept
            hidden = None
            if step.aux_hidden is not None and step.token_starts is not None:
                at = step.token_starts[j]
                hidden = step.aux_hidden[at : at + num_kept]
            computed.append(Computed(req, start, num_kept, hidden))
        if computed:
            self.proposer.observe(computed)
