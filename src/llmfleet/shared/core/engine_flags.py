"""Command-line flags for every `EngineConfig` field: the worker's own (`python -m
llmfleet.services.worker`) and `llmfleet up`'s, which it forwards to each worker it starts.

A field's flag is its name with dashes (`max_num_seqs` -> `--max-num-seqs`); its type follows
the field's annotation, and a boolean field is a pair `--x` / `--no-x`. A flag left out parses
as None, which leaves the `LLMFLEET_<FIELD>` variable or the field's default in place.
`engine_argv` turns parsed values back into flags, so what `llmfleet up` was given reaches
the workers unchanged. Every field has a help text here (a test checks it), so a new engine
setting is reachable from the command line as soon as it exists.

The nested `speculative` setting is the exception: its flags are SpeculativeSettings' fields
(`--speculative-method`, `--num-speculative-tokens`, ...; shared/core/speculative_settings.py),
a config of their own that the worker folds into EngineConfig once its device is known.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection, Mapping
from typing import Any

from llmfleet.shared.core import speculative_settings
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.speculative import METHODS
from llmfleet.shared.core.speculative_settings import SpeculativeSettings

HELP = {
    "model": "HF checkpoint directory or .gguf file (default: the bundled SmolLM2)",
    "device": "cpu, cuda or cuda:N (default cpu)",
    "dtype": "weights and KV cache dtype (default float32)",
    "block_size": "tokens per KV block, a power of two (default 16)",
    "num_kv_blocks": "KV cache size in blocks (default: from --kv-cache-bytes)",
    "kv_cache_bytes": "KV cache size in bytes when --num-kv-blocks is not given (default: on "
    "CUDA what --gpu-memory-utilization leaves after the weights, else 1 GiB)",
    "gpu_memory_utilization": "share of the GPU's memory this worker may use (default 0.9; "
    "0.45 each for two workers on one GPU)",
    "max_num_seqs": "sequences per engine step (default 256 on CUDA, 64 elsewhere)",
    "max_num_batched_tokens": "tokens per engine step (default 8192 on CUDA, 2048 elsewhere)",
    "max_model_len": "context length cap (default: the model's)",
    "enable_prefix_caching": "share cached KV blocks between requests with a common prefix",
    "encoder_cache_mb": "vision-language models: MiB of encoder outputs kept by image content "
    "hash (default 256; running requests' entries are kept beyond it)",
    "max_n": "completions per request, at most (default 16)",
    "max_logprobs": "top logprobs per position, at most (default 20)",
    "num_threads": "intra-op CPU threads (default: torch's on a CPU device, split among "
    "`llmfleet up`'s CPU workers; 1 with CUDA)",
    "cuda_graph_max_batch_size": "CUDA: replay graphs for decode steps of up to this many rows, "
    "a row being a sequence's token or one of its drafts (default: --max-num-seqs times "
    "1 + --num-speculative-tokens, at most 512; 0: eager)",
    "async_scheduling": "CUDA graphs: launch each decode step before the previous one's tokens "
    "are read back (default on)",
    "tensor_parallel_size": "split the model over N ranks (processes this worker starts on "
    "this machine, but see --tp-local-ranks; CUDA: devices cuda:0..N-1) (default 1)",
    "tp_local_ranks": "tensor parallelism across machines: ranks this worker runs itself "
    "(default: all); the others join it with --tp-join",
    "tp_port": "the port the ranks joining from other machines reach this worker's group at "
    "(every interface; needed with --tp-local-ranks)",
    "tp_join": "run one rank of another worker's tensor-parallel group: the leader's HOST:PORT "
    "(its --tp-port); takes its model and settings, never registers with a router",
    "tp_rank": "with --tp-join: this process's rank in the group, 1..N-1",
    "tp_all_reduce": "auto: decode-size sums over GPUs of one host read each other's memory in "
    "one kernel with the norm after them, NCCL elsewhere; nccl: NCCL for every sum (default "
    "auto)",
    "quantization": "fp8: quantize the decoder projections to FP8 at load (CUDA sm_89+, "
    "16-bit dtype)",
    "load_format": "auto: the checkpoint's weights; dummy: its config and tokenizer with random "
    "weights, no weight file read (benchmarks of real shapes)",
    "simulate": "run a simulated model: the checkpoint's tokenizer, a step-time model for its "
    "forward pass (no weights, no accelerator)",
    "sim_step_ms": "simulated: milliseconds every step takes (default 5.5)",
    "sim_decode_ms_per_seq": "simulated: milliseconds per decoding sequence (default 0.055)",
    "sim_prefill_ms_per_token": "simulated: milliseconds per prompt token (default 0.04)",
    "speculative": "speculative decoding: the --speculative-* flags, --num-speculative-tokens, "
    "--ngram-min and --ngram-max",
}
# EngineConfig fields set through flags of their own config (not one flag of the same name).
NESTED = ("speculative",)
# A tensor-parallel group spanning machines (a worker's own flags): `llmfleet up` starts every
# rank on this machine, so it has none of these.
TP_GROUP_FLAGS = ("tp_local_ranks", "tp_port", "tp_join", "tp_rank")
_CHOICES = {
    "quantization": ["fp8"],
    "load_format": ["auto", "dummy"],
    "tp_all_reduce": ["auto", "nccl"],
}


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_engine_flags(parser: argparse.ArgumentParser, *, skip: Collection[str] = ()) -> None:
    """One flag per EngineConfig field not in `skip`; each parses to None when left out."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip or f.name in NESTED:
            continue
        flag = "--" + f.name.replace("_", "-")
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"default": None, "help": HELP[f.name]}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is int:
            kwargs["type"] = lambda s: int(s, 0)
            kwargs["metavar"] = "N"
        elif base is float:
            kwargs["type"] = float
            kwargs["metavar"] = "X"
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        parser.add_argument(flag, dest=f.name, **kwargs)
    if "speculative" not in skip:
        add_speculative_flags(parser)


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    """SpeculativeSettings' flags (and vLLM's spellings of them); each parses to None when left
    out."""
    hints = typing.get_type_hints(SpeculativeSettings)
    for f in dataclasses.fields(SpeculativeSettings):
        flags = ["--" + f.name.replace("_", "-"), *speculative_settings.ALIASES.get(f.name, ())]
        kwargs: dict[str, Any] = {"default": None, "help": speculative_settings.HELP[f.name]}
        if _base_type(hints[f.name]) is int:
            kwargs["type"] = lambda s: int(s, 0)
            kwargs["metavar"] = "N"
        if f.name == "speculative_method":
            kwargs["choices"] = METHODS
        elif f.name == "speculative_model":
            kwargs["metavar"] = "PATH"
        elif f.name == "speculative_disable_batch_size":
            kwargs["metavar"] = "{auto,never,N}"
        parser.add_argument(*flags, dest=f.name, **kwargs)


def engine_argv(values: Mapping[str, Any]) -> list[str]:
    """The worker flags that set these EngineConfig fields (None values are left out)."""
    argv: list[str] = []
    for name, value in values.items():
        if value is None or name in NESTED:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
