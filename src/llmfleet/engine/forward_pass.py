"""What runs a step's forward pass and samples from it: the model's weights (`ModelRunner`,
`Sampler`; on CUDA with decode graphs captured) or a simulated model's step-time model
(`SimulatedRunner`, `SimulatedSampler`), and loading the model an `EngineConfig` asks for.
A tensor-parallel worker's rank 0 runs a `TPModelRunner`, which has the other ranks run each
step with it.
"""

from __future__ import annotations

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.flops import ModelShape
from llmfleet.engine.memory import num_kv_blocks
from llmfleet.engine.mm_inputs import MultimodalInputs
from llmfleet.engine.model_runner import ModelRunner, kv_bytes_per_block
from llmfleet.engine.sampler import Sampler
from llmfleet.engine.simulated import SimulatedRunner, SimulatedSampler
from llmfleet.engine.tp_ranks import Ranks, TPLoadedModel
from llmfleet.engine.tp_runner import TPModelRunner
from llmfleet.models.loader import LoadedModel, ModelSpec, load_model, load_simulated
from llmfleet.models.parallel import TensorParallel
from llmfleet.models.simulated import SimulatedModel, StepTime
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError


def torch_device(name: str) -> torch.device:
    """The device `name` names; a bare "cuda" is the current CUDA device, by its index
    (`torch.cuda.set_device` and CUDA IPC take only an indexed device)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_device(config: EngineConfig, spec: ModelSpec) -> torch.device:
    """The engine's device, once `spec` (the loaded model's) matches `config`'s dtype and the
    intra-op thread count is set."""
    if spec.dtype != config.torch_dtype:  # the KV cache is made in the config's dtype
        raise ValidationError(
            "dtype",
            f"the model was loaded in {spec.dtype}, the engine is configured for {config.dtype}",
        )
    device = torch_device(config.device)
    # A GPU engine's host tensor work is small (KV payloads, inputs); torch's default of a
    # thread per core makes every such op wake a team that then spins, cores at a time.
    threads = config.num_threads or (1 if device.type == "cuda" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    return device


def load_for(config: EngineConfig) -> LoadedModel:
    """The model `config` asks for: its checkpoint's weights, or (`simulate`) its simulated
    model. With `tensor_parallel_size` > 1 this process is rank 0: it starts the other ranks
    (tp_ranks.py), which load their shards meanwhile, and returns its own shard with them."""
    if config.simulate:
        return load_simulated(config.model, dtype=config.torch_dtype)
    if config.tensor_parallel_size == 1:
        return load_shard(config, None)
    ranks = Ranks(config)
    try:
        loaded = load_shard(config, ranks.tp)
    except BaseException:
        ranks.pending = True  # the followers may be loading: kill them
        ranks.close()
        raise
    return TPLoadedModel(loaded.model, loaded.spec, loaded.tokenizer, ranks)


def load_shard(config: EngineConfig, tp: TensorParallel | None) -> LoadedModel:
    """Rank `tp.rank`'s shard of the checkpoint's model (None: all of it)."""
    return load_model(
        config.model,
        dtype=config.torch_dtype,
        device=config.device,
        quantization=config.quantization,
        tp=tp,
        load_format=config.load_format,
    )


def kv_cache_blocks(
    config: EngineConfig, loaded: LoadedModel, shape: ModelShape | None, device: torch.device
) -> int:
    """The KV cache's block count for `loaded` on `device` (memory.py; `config` resolved).
    Tensor parallelism: every rank allocates as many blocks (each of its own KV heads), so
    each rank counts what its memory holds and the group takes the smallest count."""
    block_bytes = kv_bytes_per_block(loaded.spec, config.block_size, config.torch_dtype)
    own = num_kv_blocks(config, shape, device, block_bytes)
    if isinstance(loaded, TPLoadedModel):
        return loaded.ranks.num_blocks(own)
    return own


def forward_pass(
    config: EngineConfig,
    loaded: LoadedModel,
    block_manager: BlockManager,
    device: torch.device,
    max_model_len: int,
) -> tuple[ModelRunner, Sampler]:
    """The runner (with its KV cache of `block_manager`'s blocks) and the sampler of `loaded`;
    `config` is resolved. On CUDA the calling thread's current device becomes `device` (the
    graphs' kernels and Triton's launches go to the current device)."""
    if device.type == "cuda":
        device = torch_device(str(device))
        torch.cuda.set_device(device)
    if isinstance(loaded.model, SimulatedModel):
        step_time = StepTime(
            config.sim_step_ms, config.sim_decode_ms_per_seq, config.sim_prefill_ms_per_token
        )
        runner = SimulatedRunner(loaded.spec, block_manager, step_time, device=device)
        runner.mm = MultimodalInputs(loaded.model, device, 0)  # (takes no images)
        return runner, SimulatedSampler(loaded.model)
    if isinstance(loaded, TPLoadedModel):
        try:
            runner: ModelRunner = TPModelRunner(
                loaded.model,
                loaded.spec,
                block_manager,
                loaded.ranks,
                dtype=config.torch_dtype,
                device=device,
            )
        except BaseException:
            loaded.ranks.close()  # (killed if they were sent an op it did not finish)
            raise
    elif config.tensor_parallel_size > 1:
        raise ValidationError(
            "tensor_parallel_size", "needs a model loaded by load_for (the ranks' shards)"
        )
    else:
        runner = ModelRunner(
            loaded.model, loaded.spec, block_manager, dtype=config.torch_dtype, device=device
        )
    # Images: in-process encoder runs; a tensor-parallel step carries no input embeddings.
    tp = isinstance(loaded, TPLoadedModel)
    runner.mm = MultimodalInputs(
        loaded.model, device, config.encoder_cache_mb << 20, tensor_parallel=tp
    )
    graph_batch = min(config.cuda_graph_max_batch_size or 0, config.decode_rows)
    if device.type == "cuda" and graph_batch > 0:
        try:
            runner.capture_decode_graphs(graph_batch, max_model_len)
        except BaseException:
            runner.close()  # tensor parallelism: the other ranks too
            raise
    return runner, Sampler()
