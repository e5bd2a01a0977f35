"""Reading a GGUF file (llama.cpp's format) as an HF config plus HF-named tensors.

Facts this relies on:
- GGUF lists a tensor's dims innermost first; `GGUFReader` exposes the data in numpy order
  (rows, cols), and `gguf.quants.dequantize` returns floats of that shape.
- llama.cpp's converter permutes the rows of q/k projections of llama-arch models, per head,
  from HF's half-split rotary layout to interleaved pairs: head rows viewed as (2, D/2) become
  (D/2, 2). `_unpermute_qk` undoes it. Qwen2/Qwen3 keep HF's layout.
- Embeddings are tied when the file has no `output.weight`.
- Q4_0/Q4_1 tensors can be streamed packed (`PackedInt4`, group 32) instead of dequantized;
  the q/k row permutation then applies to the packed output columns.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from llmfleet.kernels.int4_pack import GGUF_BLOCK, pack_gguf_q4_0, pack_gguf_q4_1
from llmfleet.models.int4_linear import PackedInt4
from llmfleet.shared.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF model_type, HF architecture class name, q/k permuted by converter)
GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
SUPPORTED_QUANTS = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
}

_Q4_PACKERS = {
    gguf.GGMLQuantizationType.Q4_0: pack_gguf_q4_0,
    gguf.GGMLQuantizationType.Q4_1: pack_gguf_q4_1,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF parameter name (ModelLoadError when unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known HF equivalent")


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # (n_head * D, ...) rows per head ordered (D/2, 2) -> HF's (2, D/2).
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An open GGUF file: metadata as an HF config, tensors as an HF-named stream."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in GGUF_ARCHS:
            raise ModelLoadError(
                f"unsupported GGUF architecture {self.arch!r} in {path}; "
                f"supported: {', '.join(GGUF_ARCHS)}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensor_names:
            raise ModelLoadError(f"{path}: GGUF rope frequency factors (rope_freqs) unsupported")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def config(self) -> PretrainedConfig:
        model_type, arch_class, _ = GGUF_ARCHS[self.arch]
        required = ("block_count", "embedding_length", "attention.head_count")
        missing = [k for k in required if self.arch_field(k) is None]
        if missing:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{missing[0]}")
        hidden = int(self.arch_field("embedding_length"))
        num_heads = int(self.arch_field("attention.head_count"))
        vocab = self.arch_field("vocab_size")
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        if vocab is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata gives no vocabulary size")
        rope: dict[str, Any] = {"rope_type": "default"}
        rope["rope_theta"] = float(self.arch_field("rope.freq_base", 10000.0))
        scaling = self.arch_field("rope.scaling.type")
        if scaling == "linear":
            rope = {
                **rope,
                "rope_type": "linear",
                "factor": float(self.arch_field("rope.scaling.factor")),
            }
        elif scaling not in (None, "none"):
            raise ModelLoadError(f"{self.path}: GGUF rope scaling {scaling!r} unsupported")
        kwargs: dict[str, Any] = dict(
            architectures=[arch_class],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_field("feed_forward_length", 4 * hidden)),
            num_hidden_layers=int(self.arch_field("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(self.arch_field("attention.head_count_kv", num_heads)),
            head_dim=int(self.arch_field("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(self.arch_field("context_length", 2048)),
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in self.tensor_names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
        )
        return AutoConfig.for_model(model_type, **kwargs)

    def q4_weight_names(self) -> set[str]:
        """HF names of the 2-D tensors stored as Q4_0 or Q4_1 (those that can stay packed)."""
        return {
            hf_tensor_name(t.name)
            for t in self.reader.tensors
            if t.tensor_type in _Q4_PACKERS and len(t.shape) == 2
        }

    def tensors(
        self,
        config: PretrainedConfig,
        packed: frozenset[str] = frozenset(),
        packed_dtype: torch.dtype = torch.float16,
    ) -> Iterator[tuple[str, torch.Tensor | PackedInt4]]:
        """(HF name, tensor) for every tensor, un-permuted: float32 CPU tensors, dequantized,
        except the Q4 tensors named in `packed`, which come as `PackedInt4` (CPU tensors,
        scales and zeros in `packed_dtype`)."""
        permuted = GGUF_ARCHS[self.arch][2]
        heads = {
            "q_proj.weight": config.num_attention_heads,
            "k_proj.weight": config.num_key_value_heads,
        }
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_QUANTS:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name} has unsupported type {t.tensor_type.name}"
                )
            name = hf_tensor_name(t.name)
            n_head = next((h for suffix, h in heads.items() if name.endswith(suffix)), None)
            if name in packed:
                if t.tensor_type not in _Q4_PACKERS:
                    raise ModelLoadError(f"{self.path}: tensor {t.name} is not Q4_0/Q4_1")
                qweight, scales, zeros = _Q4_PACKERS[t.tensor_type](t.data, packed_dtype)
                p = PackedInt4(qweight, scales, zeros, GGUF_BLOCK)
                if permuted and n_head is not None:
                    p = p.permute_rows(_unpermute_qk(np.arange(p.shape[0]), n_head))
                yield name, p
                continue
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy (rows, cols) float32
            if permuted and n_head is not None:
                w = _unpermute_qk(w, n_head)
            w = np.ascontiguousarray(w, dtype=np.float32)
            if not w.flags.writeable:  # F32 tensors come straight from the read-only mmap
                w = w.copy()
            yield name, torch.from_numpy(w)
