"""A worker's step time, learned from its own steps: what a step costs with no prompt tokens in
it, and what each prompt token adds.

    model = StepTimeModel()
    model.observe(seconds, prefill_tokens=512, decode_seqs=40)   # after every engine step
    model.step_s, model.prefill_s_per_token                       # the current estimates

A step's time is modelled as `step_s + prefill_tokens * prefill_s_per_token`: decode-only steps
(no prompt tokens) move `step_s`; steps with prompt tokens move `prefill_s_per_token` by what
they took beyond the current `step_s`. Both are exponentially weighted, so the estimates follow
drift (a longer context, a busier GPU) within a few dozen steps. Until a step of a kind has been
seen its estimate is the prior given at construction. Pure Python: the router's routing scorer
reads these figures from the workers' load reports.
"""

from __future__ import annotations

from dataclasses import dataclass

# Priors, until a worker has measured its own: a small GPU model's decode step and prefill rate.
DEFAULT_STEP_S = 0.02
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4


@dataclass
class StepTimeModel:
    step_s: float = DEFAULT_STEP_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    weight: float = 0.1  # of each new observation in the moving averages
    num_decode_steps: int = 0
    num_prefill_steps: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if self.step_s < 0 or self.prefill_s_per_token < 0:
            raise ValueError("step_s and prefill_s_per_token must be >= 0")

    def observe(self, seconds: float, *, prefill_tokens: int, decode_seqs: int) -> None:
        """One engine step: its wall time, the prompt tokens it computed and the sequences it
        decoded one token for. Steps that computed nothing are ignored."""
        if seconds < 0 or prefill_tokens < 0 or decode_seqs < 0:
            raise ValueError("seconds and counts must be >= 0")
        if prefill_tokens == 0:
            if decode_seqs == 0:
                return
            self.step_s = self._mix(self.step_s, seconds, self.num_decode_steps)
            self.num_decode_steps += 1
            return
        # Before any decode-only step, the whole step is put on its prompt tokens.
        base = self.step_s if self.num_decode_steps else 0.0
        per_token = max(0.0, seconds - base) / prefill_tokens
        self.prefill_s_per_token = self._mix(
            self.prefill_s_per_token, per_token, self.num_prefill_steps
        )
        self.num_prefill_steps += 1

    def predict(self, prefill_tokens: int) -> float:
        """Seconds of one step computing `prefill_tokens` prompt tokens beside the decodes."""
        return self.step_s + prefill_tokens * self.prefill_s_per_token

    def _mix(self, old: float, new: float, seen: int) -> float:
        # The first observations count more (a plain mean up to 1 / weight of them), so the
        # prior is forgotten quickly; from then on, an exponential moving average.
        w = max(self.weight, 1.0 / (seen + 1))
        return old + w * (new - old)
