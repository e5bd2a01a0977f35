"""Images through the engine, in process, against transformers (CPU, float32), for the tiny
LLaVA (CLIP tower) and Qwen2-VL (M-RoPE) checkpoints.

Greedy tokens of prompts with 0, 1 and 2 images equal `generate`'s, batched in one step (the
encoder runs once for all their images) and chunked with a chunk boundary inside a placeholder
run; the same image again hits the prefix cache past it without an encoder run; a different
image of the same size hits only the text before it.
"""

from __future__ import annotations

import pytest
from mm_reference import (
    FAMILIES,
    SIZES,
    checkpoint,
    engine_inputs,
    hf_greedy,
    image,
    processed,
    prompt_text,
)

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.mm_inputs import MissingPixels
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.sampling_params import SamplingParams

STEPS = 6
BLOCK = 4
PARAMS = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, ignore_eos=True, temperature=0.0)


def make_engine(ckpt: str, **overrides) -> LLMEngine:
    config = dict(model=ckpt, block_size=BLOCK, num_kv_blocks=128, max_num_seqs=8)
    return LLMEngine.from_config(EngineConfig(**(config | overrides)))


def run(engine: LLMEngine, requests: dict[str, tuple]) -> tuple[dict, dict]:
    """Add every request, step to the end: (tokens, num_cached_tokens) by request id."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    cached: dict[str, int] = {}
    for rid, (ids, images, pixels) in requests.items():
        engine.add_request(rid, ids, PARAMS, images=images, pixels=pixels)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def prompts(family: str, ckpt: str) -> list[tuple[dict, tuple]]:
    """(processor output, engine inputs) of the family's prompts with 0, 1 and 2 images."""
    out = []
    for n in (0, 1, 2):
        imgs = [image(10 + i, SIZES[family][i]) for i in range(n)]
        proc = processed(family, ckpt, prompt_text(family, n), imgs)
        out.append((proc, engine_inputs(family, proc)))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, str, list]:
    fam = request.param
    ckpt = checkpoint(fam)
    cases = prompts(fam, ckpt)
    want = [hf_greedy(ckpt, proc, STEPS) for proc, _ in cases]
    return fam, ckpt, [(inputs, w) for (_, inputs), w in zip(cases, want, strict=True)]


def test_greedy_tokens_equal_transformers_batched(family):
    fam, ckpt, cases = family
    engine = make_engine(ckpt)
    if fam == "qwen2_vl":  # M-RoPE: decode positions are shifted past the images
        (ids, images, _), _ = cases[2]
        positions, delta = engine.mm.model.rope_positions(ids, images)
        assert positions.shape == (3, len(ids)) and delta < 0
    got, _ = run(engine, {f"r{i}": inputs for i, (inputs, _) in enumerate(cases)})
    assert [got[f"r{i}"] for i in range(len(cases))] == [want for _, want in cases]
    # The three prompts' first chunks share one step: one encoder run for all three images.
    assert engine.mm.num_encoder_runs == 1
    assert engine.mm.num_misses == 3 and engine.mm.num_hits == 0


def test_chunk_boundary_inside_a_placeholder_run(family):
    _, ckpt, cases = family
    (ids, images, _), _ = cases[2]
    # Alone, a request's chunks end at multiples of the budget: take one that cuts a run.
    budget = next(
        b
        for b in range(BLOCK, len(ids))
        if any(im.offset < c < im.end for im in images for c in range(b, len(ids), b))
    )
    engine = make_engine(ckpt, max_num_batched_tokens=budget)
    for i, (inputs, want) in enumerate(cases):
        got, _ = run(engine, {f"c{i}": inputs})
        assert got[f"c{i}"] == want


def test_repeated_image_hits_the_prefix_cache_and_skips_the_encoder(family):
    fam, ckpt, cases = family
    (ids, images, pixels), want = cases[1]
    [im] = images
    engine = make_engine(ckpt)
    run(engine, {"first": (ids, images, pixels)})
    runs = engine.mm.num_encoder_runs
    # Again, without pixels: the encoder output is cached (and the KV too).
    got, cached = run(engine, {"again": (ids, images, {})})
    assert got["again"] == want
    assert cached["again"] >= im.end // BLOCK * BLOCK > im.offset
    assert engine.mm.num_encoder_runs == runs

    # A different image of the same size: same placeholder tokens, a different hash.
    other = processed(fam, ckpt, prompt_text(fam, 1), [image(99, SIZES[fam][0])])
    ids2, images2, pixels2 = engine_inputs(fam, other)
    assert ids2 == ids and images2[0].content_hash != im.content_hash
    got, cached = run(engine, {"other": (ids2, images2, pixels2)})
    assert cached["other"] == im.offset // BLOCK * BLOCK
    assert engine.mm.num_encoder_runs == runs + 1
    assert got["other"] == hf_greedy(ckpt, other, STEPS)


def test_image_errors_name_the_field(family):
    _, ckpt, cases = family
    (ids, images, pixels), _ = cases[1]
    engine = make_engine(ckpt, encoder_cache_mb=0)
    with pytest.raises(MissingPixels) as e:
        engine.add_request("a", ids, PARAMS, images=images)
    assert e.value.field == "images" and e.value.hashes == [images[0].content_hash]
    [im] = images
    shifted = (type(im)(im.content_hash, im.offset - 1, im.length, im.grid),)
    with pytest.raises(ValidationError, match="placeholder") as e:
        engine.add_request("b", ids, PARAMS, images=shifted, pixels=pixels)
    assert e.value.field == "images[0]"
    # With no room in the encoder cache, a request still runs on its own pinned entry.
    got, _ = run(engine, {"c": (ids, images, pixels)})
    assert got["c"] == cases[1][1]
    assert len(engine.mm.cache) == 0 and engine.mm.cache.num_bytes == 0


def test_text_model_refuses_images(make_checkpoint, tmp_path):
    engine = LLMEngine.from_config(
        EngineConfig(model=str(make_checkpoint("llama", tmp_path)), num_kv_blocks=32)
    )
    im = engine_inputs("llava", processed("llava", checkpoint("llava"), "x <image>", [image(1)]))
    ids, images, pixels = im
    with pytest.raises(ValidationError, match="takes no images") as e:
        engine.add_request("t", [min(t, 200) for t in ids], PARAMS, images=images, pixels=pixels)
    assert e.value.field == "images"


@pytest.mark.gpu
def test_gpu_with_decode_graphs_equals_transformers(family):
    """On CUDA (Triton attention, decode CUDA graphs, async scheduling): image steps run
    eagerly, LLaVA's decode steps replay graphs, Qwen2-VL's (shifted positions) do not."""
    fam, ckpt, cases = family
    engine = make_engine(ckpt, device="cuda")
    assert engine.runner.decode_graphs is not None
    got, _ = run(engine, {f"g{i}": inputs for i, (inputs, _) in enumerate(cases)})
    assert [got[f"g{i}"] for i in range(len(cases))] == [want for _, want in cases]
    if fam == "llava":
        assert engine.chain.num_chained_steps > 0
