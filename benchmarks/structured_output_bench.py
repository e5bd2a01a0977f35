"""Decode throughput of a batch under a JSON-schema constraint vs unconstrained, same engine.

    python benchmarks/structured_output_bench.py                  # bundled model, CPU
    python benchmarks/structured_output_bench.py --device cuda    # GPU

Each round runs `--batch` sequences (temperature 1, one seed each) to `--max-tokens`, once
constrained by a JSON schema (nested objects, enums, an array with a lower bound, a string with
a `pattern`, so no sequence ends early) and once unconstrained with `ignore_eos`; rounds
alternate to spread machine noise over both. Throughput counts only the decode steps in which
the whole batch decoded (tokens out / wall time), after one warm-up round of each (which
compiles the grammar). The cost is `1 - constrained / unconstrained`; the engine's goal is at
most 10 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from llmfleet.engine.engine import LLMEngine
from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.structured_output import StructuredOutput
from llmfleet.text.chat import tokenize_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "members": {
            "type": "array",
            "minItems": 1000,  # long enough that every sequence reaches max_tokens
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "role": {"enum": ["lead", "engineer", "designer"]},
                    "age": {"type": "integer"},
                    "skills": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "role", "age", "skills"],
            },
        },
    },
    "required": ["team", "members"],
}
PROMPT = "Describe a software team as JSON: its name and every member's name, role, age, skills."


def decode_rate(engine: LLMEngine, prompt: list[int], batch: int, params: SamplingParams) -> float:
    """Tokens per second over the steps in which all `batch` sequences decoded."""
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, replace(params, seed=i))
    started: set[str] = set()
    tokens, elapsed = 0, 0.0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = [o for o in outs if o.new_token_ids]
        full = len(started) == batch and len(new) == batch and not any(o.finished for o in outs)
        if full:
            tokens += sum(len(o.new_token_ids) for o in new)
            elapsed += dt
        started.update(o.request_id for o in new)
    return tokens / elapsed if elapsed else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    config = EngineConfig(
        device=args.device,
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=args.batch,
    )
    engine = LLMEngine(config, load_model(None, dtype=dtype, device=args.device, progress=False))
    prompt = tokenize_chat(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    base = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    plain = replace(base, ignore_eos=True)
    constrained = replace(
        base, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))
    )
    decode_rate(engine, prompt, args.batch, plain)  # warm-up
    decode_rate(engine, prompt, args.batch, constrained)  # warm-up: compiles the grammar
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        rates["unconstrained"].append(decode_rate(engine, prompt, args.batch, plain))
        rates["json_schema"].append(decode_rate(engine, prompt, args.batch, constrained))
    u = statistics.median(rates["unconstrained"])
    c = statistics.median(rates["json_schema"])
    print(f"device={args.device} batch={args.batch} max_tokens={args.max_tokens}")
    for name, r in rates.items():
        print(
            f"{name:>14}: median {statistics.median(r):8.1f} tok/s  rounds {[round(x) for x in r]}"
        )
    print(f"constrained/unconstrained = {c / u:.3f}  cost = {100 * (1 - c / u):.1f} %")
    engine.close()


if __name__ == "__main__":
    main()
