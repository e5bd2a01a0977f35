"""The engine's configuration: model, KV cache, batching and device settings (a frozen
dataclass validated on construction; `config.from_env` reads it from `LLMFLEET_<FIELD>`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """The engine core of one worker (any role)."""

    model: str | None = None  # HF checkpoint dir or .gguf file; None: the bundled SmolLM2
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    block_size: int = 16
    # KV cache size: an explicit block count wins; otherwise `kv_cache_bytes` is divided by the
    # model's bytes per block. Unset on a CUDA device: what `gpu_memory_utilization` of the GPU
    # leaves after the weights and a step's activations (engine/memory.py); elsewhere 1 GiB.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # The share of the GPU's memory this worker may use in all; two workers on one GPU split it.
    gpu_memory_utilization: float = 0.9
    # Sequences and tokens per step; unset: 256 and 8192 on a CUDA device, 64 and 2048 elsewhere.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # Vision-language models: the encoder-output cache's bound in MiB (engine/encoder_cache.py;
    # the entries of running requests are kept beyond it).
    encoder_cache_mb: int = 256
    max_n: int = 16
    max_logprobs: int = 20
    # Intra-op CPU threads; None: torch's default on a CPU device, 1 with a CUDA device.
    num_threads: int | None = None
    # CUDA devices: decode steps of up to this many rows replay CUDA graphs captured at
    # start-up (capped by `decode_rows`); 0 runs every step eagerly; unset: `decode_rows`, at
    # most 512. A row is a sequence's token or one of its drafts. Ignored on the CPU.
    cuda_graph_max_batch_size: int | None = None
    # With CUDA graphs: launch the next decode step from the current one's token ids on the
    # device, before reading them back, so the host's work hides under the GPU's
    # (engine/async_scheduling.py).
    async_scheduling: bool = True
    # Ranks this worker's model is split over (tensor parallelism): rank 0 runs the engine, the
    # others (processes it starts on this machine, device cuda:rank on CUDA) run every step's
    # forward pass with it (engine/tp_runner.py).
    tensor_parallel_size: int = 1
    # Tensor parallelism across machines (engine/tp_ranks.py). The leader runs ranks
    # 0..tp_local_ranks-1 itself (None: all) and the others join it from other machines at
    # its rendezvous port `tp_port`. A joining process (`tp_join` = the leader's HOST:PORT)
    # runs rank `tp_rank` only: the leader's model and settings on its own device and memory.
    tp_local_ranks: int | None = None
    tp_port: int = 0
    tp_join: str | None = None
    tp_rank: int | None = None
    # How a CUDA group sums: "auto" sums of up to 64 rows (decode steps) with the one-shot
    # all-reduce where the ranks are GPUs of one host that read each other's memory
    # (kernels/all_reduce.py), fused with the norm after it, and NCCL elsewhere; "nccl" always
    # NCCL.
    tp_all_reduce: str = "auto"
    # Online weight quantization at load: None (serve the checkpoint's weights in `dtype`) or
    # "fp8" (decoder projections as FP8 e4m3 W8A8; CUDA sm_89+, dtype bfloat16/float16).
    quantization: str | None = None
    # "auto": the checkpoint's weights; "dummy": its config and tokenizer with random weights
    # (no weight file read): benchmarks of real shapes whose weights are not at hand.
    load_format: str = "auto"
    # A simulated model (models/simulated.py): the checkpoint's tokenizer and KV geometry, no
    # weights, and a forward pass that takes sim_step_ms + sim_decode_ms_per_seq per decoding
    # sequence + sim_prefill_ms_per_token per prompt token (defaults: an 8B model on one
    # H100-class GPU), for benchmarking and testing the fleet on CPUs.
    simulate: bool = False
    sim_step_ms: float = 5.5
    sim_decode_ms_per_seq: float = 0.055
    sim_prefill_ms_per_token: float = 0.04
    # Speculative decoding (engine/spec_decode/): None never drafts tokens.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValidationError("speculative", "must be a SpeculativeConfig or unset")
        if self.speculative is not None and self.simulate:
            raise ValidationError("speculative", "a simulated model has no logits to verify")
        for name in ("sim_step_ms", "sim_decode_ms_per_seq", "sim_prefill_ms_per_token"):
            if not 0 <= getattr(self, name) <= 60_000:
                raise ValidationError(name, f"must be in [0, 60000], got {getattr(self, name)}")
        if self.simulate and self.quantization is not None:
            raise ValidationError("quantization", "a simulated model has no weights to quantize")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValidationError(
                "dtype", f"must be float32, bfloat16 or float16, got {self.dtype}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValidationError("load_format", f"must be auto or dummy, got {self.load_format}")
        if self.quantization not in (None, "fp8"):
            raise ValidationError("quantization", f"must be fp8 or unset, got {self.quantization}")
        if self.quantization == "fp8" and (
            self.dtype == "float32" or not self.device.startswith("cuda")
        ):
            raise ValidationError(
                "quantization",
                f"fp8 needs device cuda and dtype bfloat16 or float16 "
                f"(got device {self.device}, dtype {self.dtype})",
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValidationError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValidationError("kv_cache_bytes", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValidationError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        batched = self.max_num_batched_tokens
        if batched is not None and batched < self.block_size:
            raise ValidationError(
                "max_num_batched_tokens",
                f"must be >= block_size ({self.block_size}), got {batched}",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.encoder_cache_mb < 0:
            raise ValidationError("encoder_cache_mb", f"must be >= 0, got {self.encoder_cache_mb}")
        if self.max_n < 1 or self.max_logprobs < 0:
            raise ValidationError("max_n", "max_n must be >= 1 and max_logprobs >= 0")
        if self.tensor_parallel_size < 1:
            raise ValidationError(
                "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.simulate and self.tensor_parallel_size > 1:
            raise ValidationError("tensor_parallel_size", "a simulated model runs on one rank")
        self._check_tp_group()
        if self.cuda_graph_max_batch_size is not None and self.cuda_graph_max_batch_size < 0:
            raise ValidationError(
                "cuda_graph_max_batch_size",
                f"must be >= 0 (0 disables CUDA graphs), got {self.cuda_graph_max_batch_size}",
            )

    def _check_tp_group(self) -> None:
        size, local = self.tensor_parallel_size, self.tp_local_ranks
        if local is not None and not 1 <= local <= size:
            raise ValidationError("tp_local_ranks", f"must be in [1, {size}], got {local}")
        if not 0 <= self.tp_port <= 65535:
            raise ValidationError("tp_port", f"must be a port number, got {self.tp_port}")
        if local is not None and local < size and self.tp_port == 0:
            raise ValidationError("tp_port", "ranks that join from other machines need a port")
        if self.tp_all_reduce not in ("auto", "nccl"):
            raise ValidationError("tp_all_reduce", f"auto or nccl, not {self.tp_all_reduce!r}")
        if (self.tp_join is None) != (self.tp_rank is None):
            raise ValidationError("tp_join", "tp_join and tp_rank go together")
        if self.tp_join is not None:
            host, _, port = self.tp_join.rpartition(":")
            if not host or not port.isdigit():
                raise ValidationError("tp_join", f"must be HOST:PORT, got {self.tp_join}")
            if size < 2:
                raise ValidationError("tensor_parallel_size", "a joining rank's group has 2+ ranks")
            if self.tp_rank is None or not 1 <= self.tp_rank < size:
                raise ValidationError("tp_rank", f"must be in [1, {size - 1}], got {self.tp_rank}")

    def resolved(self) -> EngineConfig:
        """This config with its device's defaults for the sizes left unset (`kv_cache_bytes`
        stays: the engine sizes it once the weights are loaded). CPU ranks of a tensor-parallel
        worker split the cores unless `num_threads` is set."""
        gpu = self.device.startswith("cuda") and not self.simulate
        seqs = self.max_num_seqs or (256 if gpu else 64)
        graphs = self.cuda_graph_max_batch_size
        threads = self.num_threads
        local = 1 if self.tp_join else (self.tp_local_ranks or self.tensor_parallel_size)
        if threads is None and not gpu and local > 1:
            threads = max(1, (os.cpu_count() or 1) // local)  # the ranks on this machine
        return dataclasses.replace(
            self,
            num_threads=threads,
            max_num_seqs=seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if gpu else 2048),
            cuda_graph_max_batch_size=min(seqs * self.rows_per_sequence, 512)
            if graphs is None
            else graphs,
        )

    @property
    def rows_per_sequence(self) -> int:
        """Decode rows one running sequence may bring to a step: its token and its drafts."""
        return 1 + (self.speculative.num_speculative_tokens if self.speculative else 0)

    @property
    def decode_rows(self) -> int:
        """Rows of the largest decode step: every sequence with its drafts (after `resolved`)."""
        return (self.max_num_seqs or 0) * self.rows_per_sequence

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)
