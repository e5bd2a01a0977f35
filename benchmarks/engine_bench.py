"""Engine benchmark on this machine's CPU: ours vs transformers `generate`, side by side.

    make bench                       # or: .venv/bin/python benchmarks/engine_bench.py

Same model (the bundled SmolLM2-135M-Instruct, dequantized), same dtype (float32), same
thread count, in one run:
  - single-request decode tokens/s (decode only: the prefill's time is subtracted),
  - total output tokens/s with 16 concurrent requests (ours; transformers' single figure as
    the baseline the target is stated against),
  - time to first token of a 500-token prompt.
Prints a table; paste it with date, machine and command into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.checkpoint_files import resolve_model_path
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    text = " ".join(
        f"Paragraph {salt}.{i}: the quick brown fox jumps over the lazy dog." for i in range(n)
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:n]


def bench_ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", p, params)
    n_out = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            n_out += len(out.new_token_ids)
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    total = time.perf_counter() - t0
    ttft = max(first.values()) - t0
    return {
        "total_s": total,
        "ttft_s": ttft,
        "out_tokens": n_out,
        "throughput": n_out / total,
        # decode rate per sequence, prefill excluded
        "decode_tps": (max_tokens - 1) / max(max(done.values()) - max(first.values()), 1e-9),
    }


def bench_hf(model, ids: list[int], max_new: int) -> tuple[float, float]:
    """(decode tokens/s, time to first token) of transformers generate, greedy, no eos stop."""
    x = torch.tensor([ids])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t_first = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, **kwargs)
        t_all = time.perf_counter() - t
    assert out.shape[1] - len(ids) == max_new
    return (max_new - 1) / (t_all - t_first), t_first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t = time.perf_counter()
    loaded = load_model(None, dtype=torch.float32)
    load_s = time.perf_counter() - t
    engine = LLMEngine(EngineConfig(), loaded)
    tok = loaded.tokenizer
    short = prompt_ids(tok, 32)
    long = prompt_ids(tok, 500)
    # Warm-up: first-call allocations and lazy init do not count.
    bench_ours(engine, [prompt_ids(tok, 20, salt=99)], 4)

    single = bench_ours(engine, [short], args.max_tokens)
    multi = bench_ours(
        engine,
        [prompt_ids(tok, 32, salt=s + 1) for s in range(args.concurrency)],
        args.max_tokens,
    )
    ttft = bench_ours(engine, [prompt_ids(tok, 500, salt=7)], 1)["ttft_s"]

    hf_tps = hf_ttft = float("nan")
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(None)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        model_generate_warm = prompt_ids(tok, 20, salt=98)
        bench_hf(hf, model_generate_warm, 4)
        hf_tps, _ = bench_hf(hf, short, args.max_tokens)
        _, hf_ttft = bench_hf(hf, long, 2)

    print(
        f"\n# llmfleet engine bench — {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
        f"float32, model load {load_s:.1f} s"
    )
    print("| metric | llmfleet | transformers generate | ratio |")
    print("|---|---|---|---|")
    print(
        f"| single-request decode tok/s (32-token prompt, {args.max_tokens} out) | "
        f"{single['decode_tps']:.1f} | {hf_tps:.1f} | {single['decode_tps'] / hf_tps:.2f}x |"
    )
    print(
        f"| {args.concurrency} concurrent requests, total output tok/s | "
        f"{multi['throughput']:.1f} | {hf_tps:.1f} (single) | "
        f"{multi['throughput'] / hf_tps:.2f}x |"
    )
    print(f"| TTFT, 500-token prompt (s) | {ttft:.3f} | {hf_ttft:.3f} | {ttft / hf_ttft:.2f}x |")
    print(f"\ntargets: decode >= 1.0x, {args.concurrency}-concurrent >= 4.0x")


if __name__ == "__main__":
    main()
