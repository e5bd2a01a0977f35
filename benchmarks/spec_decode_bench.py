"""Speculative decoding on one device: what drafting buys, what the mechanism costs, and the
batch size where it stops paying.

    python3 benchmarks/spec_decode_bench.py [--write-threshold]   # CUDA, bf16 (the issue's run)
    python3 benchmarks/spec_decode_bench.py --device cpu --tiny   # the same code paths, seconds

(a) n-gram (prompt lookup) on the bundled SmolLM2-135M-Instruct: chat prompts asking to
    repeat or edit a given text of several paragraphs, batch 1, greedy: output tokens/s of the
    decode phase without speculation and with k in {2, 4, 6, 8}, with the acceptance rate
    (accepted / drafted) and the mean accepted length (tokens per draft: 1 + accepted /
    drafts). Target: >= 2x at the best k.
(b) the Llama-3-8B shape with random weights (load format dummy: a config and a tokenizer,
    no weight file): the target as its own draft (acceptance 1, the upper bound of what drafting
    buys; its weights shared, so the cost is the draft's forward passes and cache) and a
    layer-truncated draft (its first 4 of 32 layers): ms per output token at batch 1 against k
    in {1, 2, 4, 8}, beside no speculation: the mechanism's overhead shows as the gap between
    the self-draft's time and (target step) x (k + 1 draft steps) / (k + 1 tokens).
(c) n-gram batch sweep (1..64 sequences of (a)'s prompts, ignore_eos, fixed lengths) with and
    without speculation: output tokens/s; the largest batch at which speculation still wins is
    this device's threshold, recorded for `--speculative-disable-batch-size auto` with
    `--write-threshold` (engine/spec_decode/thresholds/), then what a worker resolves "auto" to.

Every run is greedy, so each configuration should emit the same tokens: checked, a mismatch
fails in float32 and is reported in bfloat16, where a verification pass rounds differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from e2e_llama3_bench import llama3_8b_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.spec_decode import threshold
from llmfleet.models.loader import LoadedModel, load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.speculative import SpeculativeConfig
from llmfleet.text.chat import tokenize_chat

TEXT = [
    "The river town of Marlow wakes before the sun. Bakers light their ovens at four, and by "
    "five the smell of bread drifts down to the water, where the first barges are already "
    "loading crates of apples, wool and slate for the cities downstream.",
    "In spring the river rises and the lower streets flood for a week or two. Nobody minds "
    "much: the shops move their goods upstairs, the children sail paper boats along the "
    "pavements, and the old ferryman charges a penny to row people from door to door.",
    "In autumn the town holds its market fair. Farmers bring cheese and cider from the hills, "
    "a brass band plays on the bridge, and at dusk lanterns are floated on the river, one for "
    "every family, drifting slowly past the church towards the sea.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text, replacing every occurrence of 'river' with 'canal' and "
    "changing nothing else:\n\n{text}",
    "Correct the spelling mistakes in the following text and output the whole corrected "
    "text:\n\n{typos}",
]


def typos(text: str) -> str:
    return text.replace("the ", "teh ").replace("and ", "adn ")


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    paragraphs: int  # of TEXT in each (a)/(c) prompt
    tasks: int  # of TASKS: one prompt each
    a_ks: tuple[int, ...]
    a_max_tokens: int
    b_config_kwargs: dict
    b_truncated_layers: int
    b_ks: tuple[int, ...]
    b_prompt: int
    b_tokens: int
    c_batches: tuple[int, ...]
    c_ks: tuple[int, ...]
    c_tokens: int
    num_kv_blocks: int
    max_num_seqs: int


FULL = Plan(
    device="cuda", dtype="bfloat16", paragraphs=3, tasks=3, a_ks=(2, 4, 6, 8), a_max_tokens=320,
    b_config_kwargs={}, b_truncated_layers=4, b_ks=(1, 2, 4, 8), b_prompt=128, b_tokens=128,
    c_batches=(1, 2, 4, 8, 16, 24, 32, 48, 64), c_ks=(2, 4), c_tokens=128,
    num_kv_blocks=8192, max_num_seqs=64,
)  # fmt: skip
TINY = dataclasses.replace(
    FULL, device="cpu", dtype="float32", paragraphs=1, tasks=1, a_ks=(3,), a_max_tokens=24,
    b_config_kwargs=dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
    b_truncated_layers=1, b_ks=(2,), b_prompt=16, b_tokens=12, c_batches=(1, 2),
    c_ks=(3,), c_tokens=8, num_kv_blocks=512, max_num_seqs=8,
)  # fmt: skip


@dataclass
class Run:
    tokens: list[list[int]]  # per request, every output token
    decode_tokens: int  # output tokens after every request had its first
    decode_s: float
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.decode_s / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        drafts = self.emitted - self.accepted
        return self.emitted / drafts if drafts else 0.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Run:
    """All `prompts` at once; the decode phase starts once every one has its first token."""
    stats = engine.spec_stats
    before = (stats.num_drafted, stats.num_accepted, stats.num_emitted)
    tag = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    start = None
    decode_tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            out[int(o.request_id.rsplit("-", 1)[1])].extend(o.new_token_ids)
            if start is not None:
                decode_tokens += len(o.new_token_ids)
        if start is None and all(out.values()):
            sync(engine.config.device)
            start = time.perf_counter()
    sync(engine.config.device)
    seconds = time.perf_counter() - (start or time.perf_counter())
    after = (stats.num_drafted, stats.num_accepted, stats.num_emitted)
    d, a, e = (x - y for x, y in zip(after, before, strict=True))
    return Run([out[i] for i in range(len(prompts))], decode_tokens, seconds, d, a, e)


def make_engine(
    plan: Plan, loaded: LoadedModel, spec: SpeculativeConfig | None, **overrides
) -> LLMEngine:
    gc.collect()
    if plan.device.startswith("cuda"):
        torch.cuda.empty_cache()
    config = EngineConfig(
        device=plan.device,
        dtype=plan.dtype,
        num_kv_blocks=plan.num_kv_blocks,
        max_num_seqs=plan.max_num_seqs,
        speculative=spec,
        **overrides,
    )
    return LLMEngine(config, loaded)


def chat_prompts(plan: Plan, tokenizer) -> list[list[int]]:
    text = "\n\n".join(TEXT[: plan.paragraphs])
    return [
        tokenize_chat(
            tokenizer, [{"role": "user", "content": t.format(text=text, typos=typos(text))}]
        )
        for t in TASKS[: plan.tasks]
    ]


def check_same(name: str, ref: Run, run: Run, dtype: str) -> None:
    """Greedy output must equal the run without speculation. In float32 any difference fails;
    in bfloat16 a verification pass over k + 1 tokens rounds differently from a one-token step,
    so a near-tie can flip an argmax and the sequences part from there: reported, not failed."""
    if run.tokens == ref.tokens:
        return
    if dtype == "float32":
        raise SystemExit(f"{name}: greedy output differs from the run without speculation")
    parted = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(ref.tokens, run.tokens, strict=True)
        if x != y
    ]
    print(
        f"  note, {name}: {len(parted)} of {len(ref.tokens)} sequences part from the run without "
        f"speculation (bf16 rounding), at output token {sorted(parted)}"
    )


def section_a(plan: Plan, loaded: LoadedModel, prompts: list[list[int]]) -> None:
    print("\n(a) n-gram, bundled SmolLM2, repeat/edit prompts, batch 1, greedy")
    params = SamplingParams(max_tokens=plan.a_max_tokens, temperature=0.0)
    rows = []
    ref: list[Run] = []
    for k in (0, *plan.a_ks):
        spec = SpeculativeConfig("ngram", num_speculative_tokens=k) if k else None
        engine = make_engine(plan, loaded, spec)
        generate(engine, prompts[:1], dataclasses.replace(params, max_tokens=4))  # warm-up
        runs = [generate(engine, [p], params) for p in prompts]
        if k == 0:
            ref = runs
        for i, (r0, r) in enumerate(zip(ref, runs, strict=True)):
            check_same(f"(a) k={k} prompt {i}", r0, r, plan.dtype)
        total = Run([], sum(r.decode_tokens for r in runs), sum(r.decode_s for r in runs))
        for field in ("drafted", "accepted", "emitted"):
            setattr(total, field, sum(getattr(r, field) for r in runs))
        rows.append((k, total))
        del engine
    base = rows[0][1].tok_s
    print(f"{'k':>3} {'out tok/s':>10} {'speedup':>8} {'accept':>7} {'mean len':>9}")
    for k, t in rows:
        stats = f"{t.acceptance:7.2f} {t.mean_accepted_length:9.2f}" if k else f"{'-':>7} {'-':>9}"
        print(f"{k or '-':>3} {t.tok_s:10.1f} {t.tok_s / base:7.2f}x {stats}")


def shape_dir(directory: Path, config) -> Path:
    """A checkpoint directory of `config` without weights (load format dummy): config.json and
    a word-level tokenizer spelling the whole vocabulary."""
    if (directory / "config.json").is_file():
        return directory
    vocab = config.vocab_size
    config.bos_token_id, config.eos_token_id = vocab - 2, vocab - 1
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    words = {f"w{i}": i for i in range(vocab - 2)} | {"<s>": vocab - 2, "</s>": vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


def section_b(plan: Plan, root: Path) -> None:
    config = llama3_8b_config(**plan.b_config_kwargs)
    name = "llama3-8b" if not plan.b_config_kwargs else "llama3-tiny"
    path = str(shape_dir(root / f"{name}-shape", config))
    layers = config.num_hidden_layers
    print(f"\n(b) {name} shape, random weights, batch 1, ms per output token")
    dtype = getattr(torch, plan.dtype)
    loaded = load_model(path, dtype=dtype, device=plan.device, load_format="dummy")
    prompt = torch.randint(0, config.vocab_size - 2, (plan.b_prompt,)).tolist()
    params = SamplingParams(max_tokens=plan.b_tokens, temperature=0.0, ignore_eos=True)
    common = {"model": path, "load_format": "dummy", "max_model_len": 2 * plan.b_prompt + 256}

    def timed(spec: SpeculativeConfig | None) -> Run:
        engine = make_engine(plan, loaded, spec, **common)
        generate(engine, [prompt], dataclasses.replace(params, max_tokens=4))  # warm-up
        run = min((generate(engine, [prompt], params) for _ in range(2)), key=lambda r: r.decode_s)
        del engine
        return run

    ref = timed(None)
    print(f"{'draft':>18} {'k':>3} {'ms/token':>9} {'vs none':>8} {'accept':>7}")
    print(f"{'none':>18} {'-':>3} {ref.ms_per_token:9.3f} {1.0:7.2f}x {'-':>7}")
    for label, draft_layers in (
        ("self (all layers)", None),
        (f"first {plan.b_truncated_layers} of {layers}", plan.b_truncated_layers),
    ):
        for k in plan.b_ks:
            spec = SpeculativeConfig(
                "draft", num_speculative_tokens=k, model=path, draft_layers=draft_layers
            )
            run = timed(spec)
            check_same(f"(b) {label} k={k}", ref, run, plan.dtype)
            print(
                f"{label:>18} {k:>3} {run.ms_per_token:9.3f} "
                f"{run.ms_per_token / ref.ms_per_token:7.2f}x {run.acceptance:7.2f}"
            )


def section_c(plan: Plan, loaded: LoadedModel, prompts: list[list[int]], write: bool) -> None:
    print("\n(c) n-gram batch sweep (output tok/s), ignore_eos, greedy")
    params = SamplingParams(max_tokens=plan.c_tokens, temperature=0.0, ignore_eos=True)
    name = threshold.device_name(plan.device)
    results: dict[int, dict[int, Run]] = {}
    for k in (0, *plan.c_ks):
        spec = SpeculativeConfig("ngram", num_speculative_tokens=k) if k else None
        engine = make_engine(plan, loaded, spec)  # disable_batch_size None: always drafts
        generate(engine, prompts[:1], dataclasses.replace(params, max_tokens=4))  # warm-up
        results[k] = {}
        for b in plan.c_batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            results[k][b] = run = generate(engine, batch, params)
            if k:
                check_same(f"(c) k={k} batch {b}", results[0][b], run, plan.dtype)
        del engine
    head = "".join(f" {'k=' + str(k):>9} {'ratio':>6}" for k in plan.c_ks)
    print(f"{'batch':>5} {'none':>9}{head}")
    for b in plan.c_batches:
        base = results[0][b].tok_s
        cells = "".join(
            f" {results[k][b].tok_s:9.1f} {results[k][b].tok_s / base:5.2f}x" for k in plan.c_ks
        )
        print(f"{b:>5} {base:9.1f}{cells}")
    command = "python3 benchmarks/spec_decode_bench.py " + shlex.join(sys.argv[1:])
    for k in plan.c_ks:
        pays = 1
        for b in plan.c_batches:
            if results[k][b].tok_s <= results[0][b].tok_s:
                break
            pays = b
        print(f"k={k}: speculation pays up to batch {pays} on {name}")
        if write:
            path = threshold.write_measured(name, "ngram", k, pays, command)
            print(f"  written to {path}")
        value, source = threshold.resolve(plan.device, "ngram", k)
        print(f"  a worker with --speculative-disable-batch-size auto: {value} ({source})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="small sizes: the code paths in seconds")
    p.add_argument("--sections", default="abc", help="which of a, b, c to run (default abc)")
    p.add_argument(
        "--write-threshold",
        action="store_true",
        help="(c): record the measured threshold for this device (engine/spec_decode/thresholds/)",
    )
    p.add_argument(
        "--shape-dir",
        default=str(Path(tempfile.gettempdir()) / "llmfleet-spec-bench"),
        help="(b): where the weightless config directories are kept",
    )
    args = p.parse_args()
    plan = dataclasses.replace(TINY if args.tiny else FULL, device=args.device)
    if not plan.device.startswith("cuda"):
        plan = dataclasses.replace(plan, dtype="float32")
    name = threshold.device_name(plan.device)
    print(f"{name}, torch {torch.__version__}, {plan.dtype}")
    if "a" in args.sections or "c" in args.sections:
        smol = load_model(None, dtype=getattr(torch, plan.dtype), device=plan.device)
        prompts = chat_prompts(plan, smol.tokenizer)
        print(f"prompts: {[len(x) for x in prompts]} tokens")
        if "a" in args.sections:
            section_a(plan, smol, prompts)
        if "c" in args.sections:
            section_c(plan, smol, prompts, args.write_threshold)
        del smol
    if "b" in args.sections:
        section_b(plan, Path(args.shape_dir))


if __name__ == "__main__":
    main()
