"""What runs a step's forward pass and samples from it: the model's weights (`ModelRunner`,
`Sampler`; on CUDA with decode graphs captured) or a simulated model's step-time model
(`SimulatedRunner`, `SimulatedSampler`), and loading the model an `EngineConfig` asks for.
"""

from __future__ import annotations

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.model_runner import ModelRunner
from llmfleet.engine.sampler import Sampler
from llmfleet.engine.simulated import SimulatedRunner, SimulatedSampler
from llmfleet.models.loader import LoadedModel, load_model, load_simulated
from llmfleet.models.simulated import SimulatedModel, StepTime
from llmfleet.shared.core.config import EngineConfig


def load_for(config: EngineConfig) -> LoadedModel:
    """The model `config` asks for: its checkpoint's weights, or (`simulate`) its simulated
    model."""
    if config.simulate:
        return load_simulated(config.model, dtype=config.torch_dtype)
    return load_model(
        config.model,
        dtype=config.torch_dtype,
        device=config.device,
        quantization=config.quantization,
    )


def forward_pass(
    config: EngineConfig,
    loaded: LoadedModel,
    block_manager: BlockManager,
    device: torch.device,
    max_model_len: int,
) -> tuple[ModelRunner, Sampler]:
    """The runner (with its KV cache of `block_manager`'s blocks) and the sampler of `loaded`;
    `config` is resolved."""
    if isinstance(loaded.model, SimulatedModel):
        step_time = StepTime(
            config.sim_step_ms, config.sim_decode_ms_per_seq, config.sim_prefill_ms_per_token
        )
        runner = SimulatedRunner(loaded.spec, block_manager, step_time, device=device)
        return runner, SimulatedSampler(loaded.model)
    runner = ModelRunner(
        loaded.model, loaded.spec, block_manager, dtype=config.torch_dtype, device=device
    )
    graph_batch = min(config.cuda_graph_max_batch_size or 0, config.max_num_seqs or 0)
    if device.type == "cuda" and graph_batch > 0:
        runner.capture_decode_graphs(graph_batch, max_model_len)
    return runner, Sampler()
