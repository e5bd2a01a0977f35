"""A worker's step time, learned from its own steps: what a step costs with no prompt tokens in
it (a base and a cost per decoded sequence), and what each prompt token adds.

    model = StepTimeModel()
    model.observe(seconds, prefill_tokens=512, decode_seqs=40)   # after every engine step
    model.predict(prefill_tokens=0, decode_seqs=64)               # seconds, as of now

A step's time is modelled as `step_s + decode_seqs * step_s_per_seq + prefill_tokens *
prefill_s_per_token`. Decode-only steps fit the first two (a linear regression on exponentially
weighted moments, so a GPU's flat step and a CPU's batch-proportional one are both learned);
steps with prompt tokens move `prefill_s_per_token` by what they took beyond the decode part.
All follow drift (a longer context, a busier device) within a few dozen steps. Until a step of
a kind has been seen its estimate is the prior given at construction. Pure Python: the router's
routing scorer reads these figures from the workers' load reports.
"""

from __future__ import annotations

from dataclasses import dataclass

# Priors, until a worker has measured its own: a small GPU model's decode step and prefill rate.
DEFAULT_STEP_S = 0.02
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4


@dataclass
class StepTimeModel:
    step_s: float = DEFAULT_STEP_S  # a decode step's base
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    step_s_per_seq: float = 0.0  # what each decoded sequence adds
    weight: float = 0.1  # of each new observation in the moving averages
    num_decode_steps: int = 0
    num_prefill_steps: int = 0
    _moments: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # E[x], E[y], E[xx], E[xy]

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
            if not self.num_decode_steps:
                # The first base seen: what prompt steps taught before it charged them the
                # whole step; their average starts over from the next one.
                self.num_prefill_steps = 0
            self._fit(float(decode_seqs), seconds)
            return
        # Before any decode-only step, the whole step is put on its prompt tokens.
        base = self.predict(0, decode_seqs) if self.num_decode_steps else 0.0
        per_token = max(0.0, seconds - base) / prefill_tokens
        self.prefill_s_per_token = self._mix(
            self.prefill_s_per_token, per_token, self.num_prefill_steps
        )
        self.num_prefill_steps += 1

    def predict(self, prefill_tokens: int, decode_seqs: int = 0) -> float:
        """Seconds of one step computing `prefill_tokens` prompt tokens beside `decode_seqs`
        decoded sequences."""
        return (
            self.step_s
            + decode_seqs * self.step_s_per_seq
            + prefill_tokens * self.prefill_s_per_token
        )

    def _fit(self, x: float, y: float) -> None:
        """One decode-only step (x sequences, y seconds) into the weighted regression."""
        seen = self.num_decode_steps
        mx, my, mxx, mxy = (
            self._mix(m, v, seen) for m, v in zip(self._moments, (x, y, x * x, x * y), strict=True)
        )
        self._moments = (mx, my, mxx, mxy)
        self.num_decode_steps += 1
        var = mxx - mx * mx
        if var > 0.25:  # batch sizes vary enough to tell the slope (else keep the last one)
            slope = (mxy - mx * my) / var
            self.step_s_per_seq = min(max(0.0, slope), my / mx if mx > 0 else 0.0)
        self.step_s = max(0.0, my - self.step_s_per_seq * mx)

    def _mix(self, old: float, new: float, seen: int) -> float:
        return mix(old, new, seen, self.weight)


def mix(old: float, new: float, seen: int, weight: float = 0.1) -> float:
    """`old`, a moving average of `seen` observations, moved by observation `new`. The first
    observations count more (a plain mean up to 1 / weight of them), so the starting value (a
    prior) is forgotten quickly; from then on, an exponential moving average."""
    w = max(weight, 1.0 / (seen + 1))
    return old + w * (new - old)
