"""Timing helpers shared by the GPU decode benchmarks (e2e_llama3_bench.py,
gpu_decode_bench.py, gpu_decode_profile.py): the copy bandwidth that roofline figures divide
by, the weight bytes a decode step reads, and the inter-token intervals of an engine's batch.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import RequestOutput
from llmfleet.shared.core.sampling_params import SamplingParams


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, reps: int = 20) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting read + written;
    the median of `reps` timed copies after two warm-up copies."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the parameters one decode step reads: all but the input embedding table
    (one row per token), unless the output head shares it."""
    embed = model.get_submodule("embed_tokens").weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:  # None: tied, the head reads the table
        total -= embed.numel() * embed.element_size()
    return total


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def decode_intervals(
    engine: LLMEngine, num_seqs: int, on_output: Callable[[RequestOutput], None] | None = None
) -> list[float]:
    """Step until nothing is unfinished. Returns the intervals (s) between consecutive
    `engine.step()` returns that each hand all `num_seqs` sequences one token, counting those
    that end in decode tokens (not first tokens): the batch's inter-token latencies. (With
    async scheduling a call returns the tokens of the step launched before it, so the wall
    time of one call is not a token's.)"""
    intervals: list[float] = []
    last = None  # when every sequence last received a token in one step
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if on_output is not None:
            for o in outs:
                on_output(o)
        if len(outs) == num_seqs and all(len(o.new_token_ids) == 1 for o in outs):
            if last is not None and all(o.num_output_tokens > 1 for o in outs):
                intervals.append(now - last)
            last = now
    return intervals


def engine_decode_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Median inter-token latency (ms) of a batch decoding `steps` tokens per prompt."""
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"d{tag}-{i}", p, params)
    intervals = decode_intervals(engine, len(prompts))
    if not intervals:
        raise RuntimeError(f"no pure-decode step among {steps} tokens of {len(prompts)} seqs")
    return 1e3 * statistics.median(intervals)


def with_async(engine: LLMEngine, on: bool) -> None:
    """Switch the engine's async scheduling (for A/B runs of one engine)."""
    engine.config = replace(engine.config, async_scheduling=on)
