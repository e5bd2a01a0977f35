"""Running a simulated model (models/simulated.py) in the real engine.

`SimulatedRunner` stands in for the `ModelRunner`: a step sleeps for the step-time model's
duration of its batch (`EngineConfig.sim_*`) and returns no logits. Its KV cache is real and
paged, one layer of one head of width 1 per token, so blocks are allocated, hashed, cached,
evicted, exported and imported as usual while carrying no data (KV payloads are
`(nb, 1, 2, block_size, 1, 1)`). How many blocks there are follows the checkpoint's real KV
geometry, as on a GPU.

`SimulatedSampler` stands in for the `Sampler`: the model's distribution is one-hot on its
next token, so every row gets that token (the next ordinary token after it while a row's
min_tokens mask holds it back), and a row that asks for logprobs gets logprob 0 at rank 1,
that token its only alternative with any probability.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.model_runner import ModelRunner, StepOutput
from llmfleet.engine.request import Request
from llmfleet.engine.sampler import Sampler, SamplerOutput, SamplingRow
from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.models.loader import ModelSpec
from llmfleet.models.simulated import SimulatedModel, StepTime
from llmfleet.shared.core.outputs import TokenLogprobs

logger = logging.getLogger(__name__)


class SimulatedRunner(ModelRunner):
    def __init__(
        self,
        spec: ModelSpec,
        block_manager: BlockManager,
        step_time: StepTime,
        *,
        device: torch.device,
    ) -> None:
        tiny = dataclasses.replace(spec, num_layers=1, num_kv_heads=1, head_dim=1)
        super().__init__(torch.nn.Identity(), tiny, block_manager, dtype=spec.dtype, device=device)
        self.spec = spec
        self.step_time = step_time
        # How a step spends its time; a virtual-time harness replaces it with its clock.
        self.sleep: Callable[[float], None] = time.sleep
        logger.info("simulated forward pass: %s", step_time)

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Nothing to capture: a simulated step launches no kernels."""

    def execute(self, sched: SchedulerOutput) -> StepOutput:
        self.sleep(self.step_time.seconds([s.num_new_tokens for s in sched.scheduled]))
        rows = [j for j, s in enumerate(sched.scheduled) if s.samples]
        return StepOutput(torch.empty((len(rows), 0)), rows)

    def execute_chained(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        """Never chained: there are no graphs to replay ahead of the host."""
        return None


class SimulatedSampler(Sampler):
    """The sampler of a simulated model's one-hot distribution; `logits` are not read."""

    def __init__(self, model: SimulatedModel) -> None:
        self.model = model

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        token_ids = [self._next(row) for row in rows]
        logprobs: list[TokenLogprobs | None] = []
        for row, token in zip(rows, token_ids, strict=True):
            k = row.params.logprobs
            logprobs.append(
                None if k is None else TokenLogprobs(token, 0.0, 1, [token][:k], [0.0][:k])
            )
        return SamplerOutput(token_ids, logprobs)

    def sample_ids(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        return torch.tensor([self._next(row) for row in rows], dtype=torch.long)

    def _next(self, row: SamplingRow) -> int:
        out, prompt = row.output_token_ids, row.prompt_token_ids
        previous, position = (out[-1] if out else prompt[-1]), len(prompt) + len(out)
        masked = row.stop_token_ids if len(out) < row.params.min_tokens else ()
        return self.model.next_token(previous, position, masked)
