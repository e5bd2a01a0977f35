"""Decode step time on a GPU, bfloat16 vs online FP8 (`quantization="fp8"`), CUDA graphs on.

    python3 benchmarks/fp8_decode_bench.py [--hidden 4096 --layers 4]

A random-weight Llama (weights N(0, 0.02), norms 1; Llama-3-8B's layer shape by default:
hidden 4096, 32/8 heads x 128, intermediate 14336) runs the same engine configuration in
bfloat16, then with its decoder projections quantized to FP8 in place (use_fp8_linears, what
load_model does for "fp8"). The figure is the median inter-token latency of the decode
steps (gpu_decode_bench.py's measurement), and the share of greedy tokens that
agree. The output head (vocab 32000) stays bfloat16 in both.
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_decode_bench import decode_steps
from transformers import LlamaConfig

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.fp8_linear import use_fp8_linears
from llmfleet.models.loader import random_model
from llmfleet.shared.core.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=2048,
    )
    cfg = dict(device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_num_batched_tokens=8192)
    name = f"llama h{args.hidden} L{args.layers}"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    loaded = random_model(config, dtype=torch.bfloat16, device="cuda", model_id=name)
    results = {}
    for quant in (None, "fp8"):
        if quant == "fp8":
            use_fp8_linears(loaded.model)
        weights = sum(b.numel() * b.element_size() for b in loaded.model.state_dict().values())
        engine = LLMEngine(EngineConfig(quantization=quant, **cfg), loaded)
        for batch in args.batches:
            decode_steps(engine, batch, 4)  # warm-up
            results[quant, batch] = decode_steps(engine, batch, args.steps)
        print(f"{quant or 'bf16'}: weights {weights / 2**30:.2f} GiB")
        del engine
        torch.cuda.empty_cache()
    print(f"{'model':18s} {'batch':>5s} {'bf16 ms':>8s} {'fp8 ms':>8s} {'speedup':>7s} agree")
    for batch in args.batches:
        (ms16, want), (ms8, got) = results[None, batch], results["fp8", batch]
        pairs = zip(want, got, strict=True)
        agree = sum(a == b for w, g in pairs for a, b in zip(w, g, strict=True))
        print(
            f"{name:18s} {batch:5d} {ms16:8.2f} {ms8:8.2f} {ms16 / ms8:6.2f}x "
            f"{agree / (batch * args.steps):5.0%}"
        )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f} s")
