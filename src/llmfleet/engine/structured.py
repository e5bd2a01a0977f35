"""Structured output: grammar matchers per sequence, one token bitmask per step.

    grammars = GrammarCache(tokenizer, vocab_size, eos_token_ids)
    matcher = grammars.matcher(params.structured_output, replay=tokens_generated_elsewhere)
    pending = masks.start(rows)               # before the forward pass: filled on a thread
    logits = runner.execute(...).logits       # meanwhile
    masks.apply(pending, logits)              # disallowed tokens -> -inf, in place
    matcher.accept(sampled_token)             # False: the sampler broke the grammar

Compiling: a constraint is parsed (`parse_grammar`, which the router also runs without a
vocabulary) and compiled against this model's vocabulary (xgrammar's `TokenizerInfo`, built once
on first use); compiled grammars are kept in an LRU keyed by `StructuredOutput.key`, shared by
every sequence and thread (compiling takes milliseconds to seconds: the worker compiles off the
engine thread before admitting, so `add_request` finds the grammar here).

Invariant: a sequence's matcher has accepted exactly its output tokens (replayed ones included),
so it needs no rollback: recompute after preemption keeps the output tokens. A decode step
chained ahead of the host (async_scheduling.py) reads the previous step's tokens while the
device runs its forward pass, has the matchers accept them ahead (`start_ahead_mask`) and masks
its logits before sampling; the engine appends those tokens right after. The model's EOS ids
are the grammar's stop tokens: EOS is allowed only where the grammar may end, and accepting it
terminates the matcher.

Layout: the bitmask is `(B, ceil(V / 32))` int32 on the host, row `r` for logits row `r`, bit
`t % 32` of word `t // 32` set when token `t` is allowed; only the constrained rows are filled
and applied.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from llmfleet.engine.request import Request, RequestStatus
from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.models.loader import LoadedModel
from llmfleet.models.simulated import SimulatedModel
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.structured_output import StructuredOutput, parse_grammar, xgrammar_reason

logger = logging.getLogger(__name__)

FIELD = "sampling.structured_output"


class Matcher:
    """One sequence's grammar state."""

    __slots__ = ("_m", "ahead")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        # (token, accepted) of an output token accepted before the engine appended it (a
        # chained decode step needs the next mask first: `accept_ahead`); None otherwise.
        self.ahead: tuple[int, bool] | None = None

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it."""
        return self._m.accept_token(token_id)

    def accept_ahead(self, token_id: int) -> None:
        """Accept the sequence's next output token before the engine appends it; the engine's
        `grammar_status` then takes this result instead of accepting the token again."""
        self.ahead = (token_id, self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return self._m.is_terminated()


class GrammarCache:
    """Compiled grammars of one model's vocabulary, an LRU of `capacity` entries; thread-safe."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        capacity: int = 256,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.capacity = capacity
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self.num_compiled = 0  # compilations done (misses), for tests and metrics

    @classmethod
    def of(cls, loaded: LoadedModel) -> GrammarCache | None:
        """The cache of a loaded model's vocabulary; None for a simulated model, whose sampler
        ignores the logits (it cannot honour a grammar)."""
        if isinstance(loaded.model, SimulatedModel):
            return None
        return cls(loaded.tokenizer, loaded.spec.vocab_size, loaded.spec.eos_token_ids)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # This LRU is the cache; xgrammar's own would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, s: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `s`; ValidationError (named `sampling.structured_output.<kind>`)
        when it is invalid or unsupported."""
        key = s.key
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        try:
            grammar = parse_grammar(s)
        except ValidationError as e:
            raise ValidationError(f"sampling.{e.field}", e.message) from None
        try:
            compiled = self._get_compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise ValidationError(
                f"{FIELD}.{s.kind}", f"cannot be compiled: {xgrammar_reason(e)}"
            ) from None
        with self._lock:
            self.num_compiled += 1
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, s: StructuredOutput, replay: Sequence[int] = ()) -> Matcher:
        """A fresh matcher for `s` that has accepted `replay` (tokens generated before: a
        migrated request's, a disaggregated request's first token)."""
        m = Matcher(self.compile(s))
        for i, t in enumerate(replay):
            if not m.accept(t):
                raise ValidationError(
                    f"{FIELD}.{s.kind}",
                    f"token {t} (generated token {i}) does not match the constraint",
                )
        return m


class MaskFiller:
    """Fills one step's token bitmask on a thread while the forward pass runs, then applies it.

    One pending fill at a time (the engine starts one per step and applies it before the next).
    The thread runs xgrammar alone (its own C++ threads): every torch op stays on the engine's
    thread, since torch work on a second thread gives OpenMP a second team (worker/loop.py).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._shape = xgr.get_bitmask_shape(1, vocab_size)
        self._batch = xgr.BatchGrammarMatcher()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def start(self, num_rows: int, rows: list[tuple[int, Matcher]]) -> Future[PendingMask]:
        """Start filling the bitmask of a `num_rows`-row logits batch for `rows` (logits row,
        matcher); every matcher must stay untouched until `apply`."""
        # (B, ceil(V / 32)) int32; rows not in `rows` are never read. Pinned for a CUDA copy.
        bitmask = torch.empty(
            (num_rows, self._shape[1]), dtype=torch.int32, pin_memory=self.device.type == "cuda"
        )
        return self._pool.submit(self._fill, bitmask, rows)

    def _fill(self, bitmask: torch.Tensor, rows: list[tuple[int, Matcher]]) -> PendingMask:
        indices = [r for r, _ in rows]
        self._batch.batch_fill_next_token_bitmask([m._m for _, m in rows], bitmask, indices)
        return PendingMask(bitmask, indices)

    def apply(self, pending: Future[PendingMask], logits: torch.Tensor) -> None:
        """Set the disallowed tokens of the constrained rows of `(B, V)` logits to -inf."""
        mask = pending.result()
        if logits.shape[0] != mask.bitmask.shape[0]:
            raise RuntimeError(
                f"the mask has {mask.bitmask.shape[0]} rows, the logits {logits.shape[0]}"
            )
        bitmask = mask.bitmask.to(logits.device, non_blocking=True)  # no copy on the CPU
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[1], indices=mask.indices
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PendingMask:
    __slots__ = ("bitmask", "indices")

    def __init__(self, bitmask: torch.Tensor, indices: list[int]) -> None:
        self.bitmask = bitmask  # (B, ceil(V / 32)) int32, on the host
        self.indices = indices  # the logits rows to mask


def start_mask(masks: MaskFiller, sched: SchedulerOutput) -> Future[PendingMask] | None:
    """Start filling the bitmask of a scheduled step's constrained rows; None when none of the
    sequences it samples has a matcher. Logits row r is the r-th scheduled sequence that
    samples without drafts (model_runner.py; sequences with drafts have no matcher, and
    spec_decode/speculator.py takes the draft-free rows apart)."""
    sampling = [s.request for s in sched.scheduled if s.samples and not s.spec_token_ids]
    rows = [(r, m) for r, req in enumerate(sampling) if (m := req.matcher) is not None]
    if not rows:
        return None
    return masks.start(len(sampling), rows)


def start_ahead_mask(
    masks: MaskFiller, reqs: list[Request], tokens: list[int]
) -> Future[PendingMask] | None:
    """For a decode step launched before its inputs `tokens` were on the host: accept each
    constrained request's token ahead (its matcher then stands where the step samples) and
    start filling the step's mask, row i for reqs[i]; None when no row is constrained. A
    matcher that the token ends or breaks gets no mask row: the engine finishes its request
    and drops what the step samples for it."""
    rows = []
    for r, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
        m = req.matcher
        if m is None:
            continue
        m.accept_ahead(token)
        if m.ahead is not None and m.ahead[1] and not m.terminated:
            rows.append((r, m))
    if not rows:
        return None
    return masks.start(len(reqs), rows)


def grammar_status(req: Request, *, accepted: bool = False) -> RequestStatus | None:
    """Advance `req`'s matcher by its newest token (`accepted`: it was already) and say whether
    that ends it: FINISHED_STOPPED when the grammar terminated; FINISHED_ABORTED when the token
    breaks the grammar (the mask forbade it: only a sampler bug gets here)."""
    if req.matcher is None:
        return None
    token = req.output_token_ids[-1]
    ahead, req.matcher.ahead = req.matcher.ahead, None
    if ahead is not None:
        if ahead[0] != token:
            raise RuntimeError(f"{req.request_id}: accepted {ahead[0]} ahead, appended {token}")
        accepted = ahead[1]
        if not accepted:
            logger.error(
                "%s: token %d breaks its structured output; aborting", req.request_id, token
            )
            return RequestStatus.FINISHED_ABORTED
    if not accepted and not req.matcher.accept(token):
        logger.error("%s: token %d breaks its structured output; aborting", req.request_id, token)
        return RequestStatus.FINISHED_ABORTED
    return RequestStatus.FINISHED_STOPPED if req.matcher.terminated else None
