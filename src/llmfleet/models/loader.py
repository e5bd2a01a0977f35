"""Loading a model: HF checkpoint directory (safetensors, sharded or not) or a GGUF file.

Weights are streamed: the model is built on the meta device, materialized empty in the target
dtype/device, then each checkpoint tensor is read, copied into place and dropped, so at most
one tensor beyond the model is alive at a time. Finding the files is `checkpoint_files.py`'s
part, the tokenizer and EOS ids `tokenizer.py`'s, the choice of INT4-packed layers
`int4_loading.py`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from llmfleet.kernels.int4_pack import GGUF_BLOCK
from llmfleet.models.architectures import model_class
from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.selector import select_backend
from llmfleet.models.base import CausalLM
from llmfleet.models.checkpoint_files import (
    BUNDLED_MODEL_ID,
    iter_safetensors,
    resolve_model_path,
    safetensors_files,
    safetensors_names,
)
from llmfleet.models.decoder import kv_geometry
from llmfleet.models.fp8_linear import check_quantization, use_fp8_linears
from llmfleet.models.gguf_file import GGUFFile
from llmfleet.models.int4_checkpoint import Int4CheckpointFormat, checkpoint_format
from llmfleet.models.int4_linear import use_int4_linears
from llmfleet.models.int4_loading import int4_checkpoint_weights, int4_packed_weights, keeps_int4
from llmfleet.models.layers import RMSNorm
from llmfleet.models.multimodal import text_config, text_decoder
from llmfleet.models.parallel import SINGLE, TensorParallel, kv_head_partition, take_shard
from llmfleet.models.rotary import RotaryEmbedding
from llmfleet.models.simulated import SimulatedModel
from llmfleet.models.tokenizer import (
    as_ids,
    dir_eos_ids,
    dir_tokenizer,
    eos_token_ids,
    gguf_tokenizer,
)
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """A loaded checkpoint's facts that the engine sizes itself by: identity, vocabulary, the
    checkpoint's context length, KV dimensions and the dtype it was loaded in. (What the API
    reports of a served model is `shared.core.model_info.ModelInfo`.)

    Under tensor parallelism the KV fields describe this rank's cache: `num_kv_heads` of the
    model's `total_num_kv_heads` (0: all of them), the first being global head
    `kv_head_start`."""

    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    total_num_kv_heads: int = 0
    kv_head_start: int = 0


@dataclass
class LoadedModel:
    model: CausalLM | SimulatedModel  # SimulatedModel: a step-time model, no weights
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase | None  # None: a token-ids-only model (random_model)


@dataclass
class Checkpoint:
    """What a model path holds before any weight is read."""

    path: Path  # the checkpoint directory or .gguf file
    config: Any  # its HF config (a GGUF file's is built from its metadata)
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    eos_token_ids: tuple[int, ...]  # the config's, then the tokenizer's and its end-of-turn ids
    bos_token_id: int | None
    gguf: GGUFFile | None = None  # the open GGUF file, for its tensors

    def spec(
        self, dtype: torch.dtype, architecture: str, tp: TensorParallel | None = None
    ) -> ModelSpec:
        return model_spec(
            self.config,
            self.model_id,
            dtype,
            architecture,
            eos_token_ids=self.eos_token_ids,
            bos_token_id=self.bos_token_id,
            tp=tp,
        )


def open_checkpoint(path: str | None) -> Checkpoint:
    """The config and tokenizer of `path` (None: the bundled SmolLM2-135M-Instruct); fails
    with ModelLoadError on a missing file or an unsupported architecture."""
    resolved = resolve_model_path(path)
    gf: GGUFFile | None = None
    if resolved.is_dir():
        if not (resolved / "config.json").is_file():
            raise ModelLoadError(f"{resolved} has no config.json")
        config = AutoConfig.from_pretrained(resolved)
        model_class(config)  # fail on an unsupported architecture before reading anything
        tokenizer = dir_tokenizer(resolved)
        eos_ids = dir_eos_ids(resolved, text_config(config))
        model_id = resolved.name
    elif resolved.suffix == ".gguf":
        gf = GGUFFile(resolved)
        config = gf.config()
        tokenizer = gguf_tokenizer(resolved)
        eos_ids = as_ids(config.eos_token_id)
        model_id = BUNDLED_MODEL_ID if path is None else resolved.stem
    else:
        raise ModelLoadError(f"{resolved} is neither a checkpoint directory nor a .gguf file")
    bos = getattr(text_config(config), "bos_token_id", None)
    if bos is None:
        bos = tokenizer.bos_token_id
    return Checkpoint(
        path=resolved,
        config=config,
        tokenizer=tokenizer,
        model_id=model_id,
        eos_token_ids=eos_token_ids(eos_ids, tokenizer),
        bos_token_id=None if bos is None else int(bos),
        gguf=gf,
    )


def build_model(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """An empty (uninitialized) model of `config` in `dtype` on `device`: rank `tp.rank`'s
    shard under tensor parallelism."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, backend, tp or SINGLE)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild(device)
    return model.eval()


def model_spec(
    config: Any,
    model_id: str,
    dtype: torch.dtype,
    architecture: str,
    *,
    eos_token_ids: tuple[int, ...] = (),
    bos_token_id: int | None = None,
    tp: TensorParallel | None = None,
) -> ModelSpec:
    """The spec of a model of `config` (the KV geometry as the decoder derives it, from the
    text config of a vision-language model), of rank `tp.rank`'s KV heads under tensor
    parallelism."""
    config = text_config(config)
    total_kv_heads, head_dim = kv_geometry(config)
    tp = tp or SINGLE
    kv_heads, _ = kv_head_partition(total_kv_heads, config.num_attention_heads, tp.size)[tp.rank]
    return ModelSpec(
        model_id=model_id,
        architecture=architecture,
        vocab_size=int(config.vocab_size),
        max_model_len=int(config.max_position_embeddings),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=len(kv_heads),
        head_dim=head_dim,
        hidden_size=int(config.hidden_size),
        eos_token_ids=eos_token_ids,
        bos_token_id=bos_token_id,
        dtype=dtype,
        total_num_kv_heads=total_kv_heads,
        kv_head_start=kv_heads.start,
    )


def random_model(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    model_id: str = "random",
    std: float = 0.02,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """A model of `config` with random weights made directly on `device`: no checkpoint and no
    tokenizer (token ids only; the engine needs none). Weights are N(0, `std`) and RMSNorm
    scales 1, drawn from a generator seeded with `seed`, so a seed gives the same weights on
    every call on the same device. For benchmarks and tests of real shapes.

    Under tensor parallelism `tp` each full parameter is drawn as at size 1 (one at a time)
    and this rank keeps its shard: the ranks together hold the size-1 model's weights."""
    tp = tp or SINGLE
    model = build_model(config, dtype=dtype, device=device, backend=select_backend(device), tp=tp)
    randomize(model, config, dtype=dtype, device=device, seed=seed, std=std, tp=tp)
    spec = model_spec(config, model_id, dtype, type(model).__name__, tp=tp)
    return LoadedModel(model=model, spec=spec, tokenizer=None)


@torch.no_grad()
def randomize(
    model: torch.nn.Module,
    config: Any,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    std: float = 0.02,
    tp: TensorParallel = SINGLE,
) -> None:
    """Fill `model` (this rank's shard of `config`'s model) as `random_model` describes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if tp.size == 1:
        for p in model.parameters():
            p.normal_(0.0, std, generator=gen)
    else:
        with torch.device("meta"):
            full = model_class(config)(config)
        params = dict(model.named_parameters())
        for name, p in full.named_parameters():
            t = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            params[name].copy_(take_shard(t, model.param_shard(name)))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, torch.nn.LayerNorm):  # vision towers
            module.weight.fill_(1.0)
            module.bias.zero_()


def _stream_with_progress(
    weights: Iterable[tuple[str, torch.Tensor]], total: int, enabled: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    level = logging.INFO if enabled else logging.DEBUG
    step = max(1, total // 10)
    for i, item in enumerate(weights, 1):
        yield item
        if i % step == 0 or i == total:
            logger.log(level, "loaded %d/%d tensors", i, total)


def load_model(
    path: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    progress: bool = True,
    int4_weights: bool | None = None,
    quantization: str | None = None,
    tp: TensorParallel | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """Load a model and its tokenizer. `path` None loads the bundled SmolLM2-135M-Instruct.

    `load_format` "dummy": the checkpoint's config and tokenizer with random weights
    (`randomize`), no weight file read: benchmarks of real shapes without their weights.

    `int4_weights`: keep GGUF Q4_0/Q4_1 linear weights packed (Int4Linear) instead of
    dequantizing them; None means `keeps_int4(device, dtype)`.
    `quantization` "fp8": after loading, the decoder projections are quantized to FP8
    (fp8_linear.py); needs CUDA sm_89+ and a 16-bit `dtype` (ValidationError otherwise).
    `tp`: load rank `tp.rank`'s shard (decoder.py); safetensors are read only in that part,
    GGUF and AWQ/GPTQ tensors are read whole, then cut: packed INT4 layers keep their rank's
    part packed where it falls on group boundaries (int4_loading.py), the rest is dequantized;
    FP8 quantizes each rank's shard (fp8_linear.py)."""
    start = time.perf_counter()
    tp = tp or SINGLE
    check_quantization(quantization, device, dtype)  # before reading anything
    ckpt = open_checkpoint(path)
    if load_format == "dummy":
        return _dummy_model(ckpt, dtype, device, backend, quantization, tp)
    config, resolved, gf = ckpt.config, ckpt.path, ckpt.gguf
    int4_format: Int4CheckpointFormat | None = None
    names: list[str] = []  # a checkpoint directory's tensor names
    if gf is None:
        int4_format = checkpoint_format(config)
        if int4_format is not None and text_config(config) is not config:
            raise ModelLoadError("AWQ/GPTQ checkpoints of vision-language models are not supported")
        files = safetensors_files(resolved)
        names = safetensors_names(files)
        total = len(names)
        # Lazy slices under tensor parallelism: load_weights reads the rank's part only.
        lazy = tp.size > 1 and int4_format is None
        weights: Iterable[tuple[str, Any]] = iter_safetensors(files, lazy=lazy)
    else:
        total = len(gf.reader.tensors)
        weights = gf.tensors(config)

    cls_name = model_class(config).__name__
    logger.log(
        logging.INFO if progress else logging.DEBUG,
        "loading %s (%s, %d tensors) as %s on %s",
        resolved,
        cls_name,
        total,
        dtype,
        device,
    )
    if backend is None:
        backend = select_backend(device)
    model = build_model(config, dtype=dtype, device=device, backend=backend, tp=tp)
    keep_int4 = keeps_int4(device, dtype) if int4_weights is None else int4_weights
    if gf is not None and keep_int4:
        targets, hf_names = int4_packed_weights(gf, text_decoder(model))
        use_int4_linears(model, targets, GGUF_BLOCK, dtype)
        weights = gf.tensors(config, packed=frozenset(hf_names), packed_dtype=dtype)
    elif int4_format is not None:
        weights, total = int4_checkpoint_weights(
            text_decoder(model), names, weights, int4_format, dtype, keep_int4
        )
    model.load_weights(_stream_with_progress(weights, total, progress))
    if quantization == "fp8":
        use_fp8_linears(text_decoder(model))

    spec = ckpt.spec(dtype, type(model).__name__, tp)
    logger.log(
        logging.INFO if progress else logging.DEBUG,
        "loaded %s in %.1f s",
        ckpt.model_id,
        time.perf_counter() - start,
    )
    return LoadedModel(model=model, spec=spec, tokenizer=ckpt.tokenizer)


def _dummy_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend | None,
    quantization: str | None,
    tp: TensorParallel,
) -> LoadedModel:
    backend = backend or select_backend(device)
    model = build_model(ckpt.config, dtype=dtype, device=device, backend=backend, tp=tp)
    randomize(model, ckpt.config, dtype=dtype, device=device, tp=tp)
    if quantization == "fp8":
        use_fp8_linears(text_decoder(model))
    logger.info("%s: random weights (load format dummy) on %s", ckpt.model_id, device)
    spec = ckpt.spec(dtype, type(model).__name__, tp)
    return LoadedModel(model=model, spec=spec, tokenizer=ckpt.tokenizer)


def load_simulated(path: str | None, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The simulated model of `path` (models/simulated.py): its tokenizer, EOS ids and KV
    geometry, no weights; `dtype` is the (simulated) KV cache's."""
    ckpt = open_checkpoint(path)
    special = set(ckpt.tokenizer.all_special_ids) | set(ckpt.eos_token_ids)
    vocab = int(text_config(ckpt.config).vocab_size)
    ordinary = tuple(t for t in range(min(vocab, len(ckpt.tokenizer))) if t not in special)
    model = SimulatedModel(ordinary)
    logger.info("simulating %s (%d ordinary tokens)", ckpt.model_id, len(ordinary))
    return LoadedModel(model=model, spec=ckpt.spec(dtype, "Simulated"), tokenizer=ckpt.tokenizer)
