"""Decode step time on a GPU, eager vs CUDA graphs, for small random-weight models.

    make bench-gpu                   # or: python3 benchmarks/gpu_decode_bench.py

Two models built from configs (no checkpoint; weights N(0, 0.02), norms 1), bfloat16:
  - SmolLM2-135M's shape (Llama, 30 layers, hidden 576, 9/3 heads x 64, vocab 49152),
  - a small Qwen3-MoE (8 layers, hidden 1024, 16/4 heads x 128, 32 experts top-4 x 512).
For batch 1 and 16 (prompts of 100-300 tokens) the same engine configuration runs with
`cuda_graph_max_batch_size=0` and with graphs; the figure is the median interval
between the steps that hand every sequence a decode token (scheduling, the forward pass and
sampling; with graphs, async scheduling on), and the share of greedy tokens that agree (bf16: the
padded graph batch changes matmul shapes, so a near-tie can flip).
Prints a table; paste it with date, device and command into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_timing import decode_intervals
from transformers import LlamaConfig, Qwen3MoeConfig

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import random_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams

MODELS = {
    "smollm2-135m-shape": LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "qwen3-moe-small": Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=2048,
    ),
}


def decode_steps(engine: LLMEngine, batch: int, steps: int) -> tuple[float, list[list[int]]]:
    """Median inter-token latency (ms) of the batch's decode tokens, and each sequence's
    tokens."""
    g = torch.Generator().manual_seed(batch)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        n = int(torch.randint(100, 300, (1,), generator=g))
        rid = f"b{batch}-{i}-{time.monotonic_ns()}"
        tokens[rid] = []
        engine.add_request(rid, torch.randint(0, vocab, (n,), generator=g).tolist(), params)
    times = decode_intervals(engine, batch, lambda o: tokens[o.request_id].extend(o.new_token_ids))
    times.sort()
    return 1e3 * times[len(times) // 2], list(tokens.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    cfg = dict(device="cuda", dtype="bfloat16", num_kv_blocks=1024, max_num_batched_tokens=8192)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'model':20s} {'batch':>5s} {'eager ms':>9s} {'graphs ms':>9s} {'speedup':>7s} agree")
    for name, config in MODELS.items():
        loaded = random_model(config, dtype=torch.bfloat16, device="cuda", model_id=name)
        start = time.perf_counter()
        graphed = LLMEngine(EngineConfig(**cfg), loaded)
        capture_s = time.perf_counter() - start
        if graphed.runner.decode_graphs is None:
            raise SystemExit(f"{name}: no CUDA graphs were captured")
        eager = LLMEngine(EngineConfig(cuda_graph_max_batch_size=0, **cfg), loaded)
        for batch in args.batches:
            decode_steps(eager, batch, 4)  # warm-up: kernels compiled for these shapes
            decode_steps(graphed, batch, 4)
            eager_ms, want = decode_steps(eager, batch, args.steps)
            graph_ms, got = decode_steps(graphed, batch, args.steps)
            pairs = zip(want, got, strict=True)
            agree = sum(a == b for w, g in pairs for a, b in zip(w, g, strict=True))
            print(
                f"{name:20s} {batch:5d} {eager_ms:9.2f} {graph_ms:9.2f} "
                f"{eager_ms / graph_ms:6.1f}x {agree / (batch * args.steps):5.0%}"
            )
        print(f"{name:20s} graph capture (engine start-up): {capture_s:.1f} s")
        del graphed, eager, loaded
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
