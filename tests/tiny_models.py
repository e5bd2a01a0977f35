"""Tiny random-weight HF checkpoints of every supported architecture, and a driver that runs
our model step by step over a fresh paged KV cache.

A checkpoint is a transformers model saved as safetensors plus a byte-level tokenizer with a
ChatML template (vocab: 256 bytes, then the specials below).
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import LoadedModel

VOCAB = 260  # 256 byte tokens + specials
SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=256,
    tie_word_embeddings=False,
)

ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": (
        "llama",
        {
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "moe_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
}
ARCHS = list(ARCH_CONFIGS)


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_hf_model(arch: str, **overrides: Any) -> torch.nn.Module:
    model_type, extra = ARCH_CONFIGS[arch]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Random init has tiny norms/biases; perturb them so every weight matters in the test.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_checkpoint(model: torch.nn.Module, out: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    make_tokenizer().save_pretrained(out)
    return out


def make_checkpoint(
    arch: str, out_dir: Path, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Save a tiny `arch` checkpoint (config overrides applied) into `out_dir / arch`."""
    return save_checkpoint(build_hf_model(arch, **overrides), out_dir / arch, max_shard_size)


@functools.cache
def sim_checkpoint() -> str:
    """A tiny llama checkpoint (8192 positions, like the bundled model) for fleets of simulated
    workers, which read only its tokenizer, EOS ids and KV geometry: each child process opens it
    in milliseconds, where the bundled GGUF's metadata takes seconds to parse in every one of
    them. Made once per test process; removed when it exits."""
    out = Path(tempfile.mkdtemp(prefix="llmfleet-sim-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(make_checkpoint("llama", out, max_position_embeddings=8192))


# ---- running our model over a paged cache ----

BLOCK_SIZE = 4
NUM_BLOCKS = 40
PROMPT_LENS = [5, 11, 17]


def random_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def block_tables(seq_lens: list[int]) -> list[list[int]]:
    # Non-contiguous, shuffled block ids so blocks of one sequence are scattered.
    ids = list(range(1, NUM_BLOCKS))
    random.Random(7).shuffle(ids)
    tables = []
    for n in seq_lens:
        need = -(-n // BLOCK_SIZE)
        tables.append(ids[:need])
        ids = ids[need:]
    return tables


class Runner:
    """Drives our model step by step over a fresh paged cache."""

    def __init__(self, loaded: LoadedModel, seq_lens: list[int]) -> None:
        self.model = loaded.model
        info = loaded.spec
        self.kv = [
            torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, info.num_kv_heads, info.head_dim)
            for _ in range(info.num_layers)
        ]
        self.tables = block_tables(seq_lens)

    @torch.no_grad()
    def step(self, chunks: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
        """Run chunk i at positions starts[i].. ; returns each chunk's logits (len, V)."""
        qlens = [len(c) for c in chunks]
        slens = [s + q for s, q in zip(starts, qlens, strict=True)]
        meta = AttentionMetadata.build(qlens, slens, self.tables, BLOCK_SIZE)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens, strict=True)])
        logits = self.model.compute_logits(self.model(ids, pos, self.kv, meta))
        return list(logits.split(qlens))


def hf_logits(hf: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float() for p in prompts]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, atol=1e-4 * max(scale, 1.0), rtol=1e-4)


def greedy_tokens(engine: Any, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """`steps` greedy tokens (ignore_eos) per prompt from an LLMEngine, in prompt order."""
    from llmfleet.shared.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def prefill_logits(loaded: LoadedModel, ids: list[int], device: str = "cuda") -> torch.Tensor:
    """(len(ids), V) float32 logits of one prefill of `ids` over a fresh cache on `device`."""
    info, n = loaded.spec, len(ids)
    blocks = -(-n // 16)
    shape = (2, blocks, 16, info.num_kv_heads, info.head_dim)
    kv = [torch.zeros(shape, device=device, dtype=info.dtype) for _ in range(info.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], 16, device=device)
    with torch.no_grad():
        h = loaded.model(torch.tensor(ids, device=device), torch.arange(n, device=device), kv, meta)
        return loaded.model.compute_logits(h)


def top2_margin(loaded: LoadedModel, ids: list[int], device: str = "cuda") -> float:
    """Gap between the two largest next-token logits after `ids`, relative to the largest
    magnitude: how close the greedy choice is to a tie."""
    logits = prefill_logits(loaded, ids, device)[-1]
    top = logits.topk(2).values
    return ((top[0] - top[1]) / logits.abs().max()).item()
