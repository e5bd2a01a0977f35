"""Qwen2-VL against transformers in float32: the vision tower, M-RoPE positions, and prefill
logits and greedy tokens of prompts with 0, 1 and 2 images (different grids), our model driven
step by step over a paged KV cache the way the engine drives it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mm_checkpoints.qwen2_vl import IMAGE_TOKEN_ID, make_qwen2_vl_checkpoint, processor_inputs
from PIL import Image
from tiny_models import assert_logits_close

from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.qwen2_vl import Qwen2VLForConditionalGeneration
from llmfleet.shared.core.multimodal import ImageRef, PixelInput

BLOCK_SIZE, NUM_BLOCKS, NEW_TOKENS = 8, 48, 8


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


SQUARE, WIDE, OTHER_SQUARE = _image(0, 56, 56), _image(1, 84, 112), _image(2, 56, 56)
# name -> (content parts of the user message, images in order)
PROMPTS = {
    "text": ([{"type": "text", "text": "Say something."}], []),
    "one": ([{"type": "image"}, {"type": "text", "text": "What is it?"}], [SQUARE]),
    "two": (
        [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
        [WIDE, SQUARE],
    ),
}


@pytest.fixture(scope="module")
def ckpt() -> str:
    return make_qwen2_vl_checkpoint()


@pytest.fixture(scope="module")
def hf(ckpt: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(ckpt: str) -> Qwen2VLForConditionalGeneration:
    from llmfleet.models.loader import load_model

    loaded = load_model(ckpt, dtype=torch.float32)
    assert isinstance(loaded.model, Qwen2VLForConditionalGeneration)
    return loaded.model


def _inputs(ckpt: str, parts: list[dict], images: list[Image.Image]) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": parts}]
    text = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return processor_inputs(ckpt, text, images)


def _refs_and_pixels(inp: dict[str, torch.Tensor]) -> tuple[list[ImageRef], list[PixelInput]]:
    """The placeholder runs of input_ids as ImageRefs (as the tokenizer service reports them)
    and each image's own rows of pixel_values."""
    if "image_grid_thw" not in inp:
        return [], []
    grids = [tuple(g) for g in inp["image_grid_thw"].tolist()]
    pixels = inp["pixel_values"].split([t * h * w for t, h, w in grids])
    ids = inp["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != t)]
    refs = []
    for k, (start, grid) in enumerate(zip(starts, grids, strict=True)):
        end = start
        while end < len(ids) and ids[end] == IMAGE_TOKEN_ID:
            end += 1
        refs.append(ImageRef(f"{k:064x}", start, end - start, grid))
    return refs, [PixelInput(p, g) for p, g in zip(pixels, grids, strict=True)]


class StepDriver:
    """Runs several prompts through our model over one paged cache: prompt chunks with (3, T)
    M-RoPE positions and image embeddings merged into the chunk's input embeddings, then
    batched decode steps with (T,) positions i + delta."""

    def __init__(self, model: Qwen2VLForConditionalGeneration, num_seqs: int) -> None:
        self.model = model
        self.device = model.language_model.embed_tokens.weight.device
        text = model.config.text_config
        heads = text.num_attention_heads
        kv_heads, head_dim = text.num_key_value_heads, text.hidden_size // heads
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
        self.kv = [torch.zeros(shape, device=self.device) for _ in range(text.num_hidden_layers)]
        ids = list(range(1, NUM_BLOCKS))
        random.Random(3).shuffle(ids)  # scattered blocks
        per_seq = (NUM_BLOCKS - 1) // num_seqs
        self.tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]

    @torch.no_grad()
    def step(
        self,
        ids: list[list[int]],
        starts: list[int],
        positions: torch.Tensor,  # (T,) or (3, T)
        embeds: torch.Tensor | None,
    ) -> list[torch.Tensor]:  # each chunk's logits (len, V)
        qlens = [len(c) for c in ids]
        slens = [s + q for s, q in zip(starts, qlens, strict=True)]
        tables = self.tables[: len(ids)]
        meta = AttentionMetadata.build(qlens, slens, tables, BLOCK_SIZE, device=self.device)
        flat = torch.tensor([t for c in ids for t in c], device=self.device)
        pos = positions.to(self.device)
        hidden = self.model(flat, pos, self.kv, meta, inputs_embeds=embeds)
        return list(self.model.compute_logits(hidden).cpu().split(qlens))

    def chunk_embeds(
        self,
        ids: list[int],
        start: int,
        refs: list[ImageRef],
        feats: list[torch.Tensor],
    ) -> torch.Tensor:  # (len(ids), hidden): token embeddings, image rows overwritten
        emb = self.model.embed_input_ids(torch.tensor(ids, device=self.device))
        end = start + len(ids)
        for ref, feat in zip(refs, feats, strict=True):
            lo, hi = max(ref.offset, start), min(ref.end, end)
            if lo < hi:  # this chunk holds placeholders lo..hi of the image
                emb[lo - start : hi - start] = feat[lo - ref.offset : hi - ref.offset]
        return emb


def _run_ours(
    model: Qwen2VLForConditionalGeneration, prompts: list[dict[str, torch.Tensor]]
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each prompt's prefill logits and NEW_TOKENS greedy tokens; prefill in two chunks of
    all prompts at once (the cut falls inside image placeholder runs), decode batched."""
    driver = StepDriver(model, len(prompts))
    ids = [p["input_ids"][0].tolist() for p in prompts]
    mm = [_refs_and_pixels(p) for p in prompts]
    feats = [model.encode_images(pixels) for _, pixels in mm]
    rope = [model.rope_positions(i, refs) for i, (refs, _) in zip(ids, mm, strict=True)]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    cuts = [[0, len(i) * 3 // 5, len(i)] for i in ids]
    for half in range(2):
        chunks = [i[c[half] : c[half + 1]] for i, c in zip(ids, cuts, strict=True)]
        starts = [c[half] for c in cuts]
        pos = torch.cat(
            [r[0][:, c[half] : c[half + 1]] for r, c in zip(rope, cuts, strict=True)], 1
        )
        emb = torch.cat(
            [
                driver.chunk_embeds(chunk, s, refs, f)
                for chunk, s, (refs, _), f in zip(chunks, starts, mm, feats, strict=True)
            ]
        )
        for k, out in enumerate(driver.step(chunks, starts, pos, emb)):
            logits[k].append(out)
    prefill = [torch.cat(parts) for parts in logits]
    tokens = [[int(p[-1].argmax())] for p in prefill]
    for _ in range(NEW_TOKENS - 1):
        starts = [len(i) + len(t) - 1 for i, t in zip(ids, tokens, strict=True)]
        pos = torch.tensor([s + r[1] for s, r in zip(starts, rope, strict=True)])
        outs = driver.step([[t[-1]] for t in tokens], starts, pos, None)
        for t, out in zip(tokens, outs, strict=True):
            t.append(int(out[-1].argmax()))
    return prefill, tokens


def test_prefill_logits_and_greedy_tokens_match_transformers(ckpt, hf, ours) -> None:
    prompts = [_inputs(ckpt, *PROMPTS[name]) for name in PROMPTS]
    prefill, tokens = _run_ours(ours, prompts)
    for name, inp, logits, toks in zip(PROMPTS, prompts, prefill, tokens, strict=True):
        with torch.no_grad():
            ref = hf(**inp).logits[0]
            out = hf.generate(**inp, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_logits_close(logits, ref)
        expected = out[0, inp["input_ids"].shape[1] :].tolist()
        assert toks[: len(expected)] == expected, name


def test_a_different_image_changes_the_answer(ckpt, ours) -> None:
    """The images matter: another picture of the same size (same placeholder tokens) gives
    other greedy tokens, so the comparisons above would catch an ignored image."""
    parts = PROMPTS["one"][0]
    _, (a, b) = _run_ours(
        ours, [_inputs(ckpt, parts, [SQUARE]), _inputs(ckpt, parts, [OTHER_SQUARE])]
    )
    assert a != b


@pytest.mark.parametrize("name", list(PROMPTS))
def test_rope_positions_match_get_rope_index(ckpt, hf, ours, name) -> None:
    inp = _inputs(ckpt, *PROMPTS[name])
    refs, _ = _refs_and_pixels(inp)
    positions, delta = ours.rope_positions(inp["input_ids"][0].tolist(), refs)
    ref_pos, ref_delta = hf.model.get_rope_index(
        inp["input_ids"], inp["mm_token_type_ids"], inp.get("image_grid_thw")
    )
    assert torch.equal(positions, ref_pos[:, 0])
    assert delta == int(ref_delta)
    assert (delta < 0) == bool(refs)  # an image's tokens share positions: the count drops


def test_encode_images_batched_equals_one_at_a_time_and_hf(ckpt, hf, ours) -> None:
    inp = _inputs(ckpt, *PROMPTS["two"])
    refs, pixels = _refs_and_pixels(inp)
    with torch.no_grad():
        batched = ours.encode_images(pixels)
        single = [ours.encode_images([p])[0] for p in pixels]
        ref = hf.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"]).pooler_output
    assert [f.shape[0] for f in batched] == [r.length for r in refs] == [12, 4]
    for b, s, r in zip(batched, single, ref, strict=True):
        torch.testing.assert_close(b, s, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b, r, atol=1e-4, rtol=1e-4)


def test_encode_images_rejects_pixels_that_do_not_match_the_grid(ours) -> None:
    bad = PixelInput(torch.zeros(15, 3 * 2 * 14 * 14), (1, 4, 4))
    with pytest.raises(ValueError, match="do not match grid"):
        ours.encode_images([bad])


def test_mrope_rotation_matches_transformers_and_equal_axes_are_1d(ckpt, hf, ours) -> None:
    rotary = ours.language_model.rotary_emb
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 200, (3, 9), generator=g)
    rope = rotary.at(positions)
    cos, sin = rope.cos_sin()  # (T, 1, D/2)
    x = torch.randn(9, 1, 16, generator=g)  # (T, heads, head_dim)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(x, positions.unsqueeze(1))  # (3,1,T)
    torch.testing.assert_close(cos[:, 0], ref_cos[0, :, :8], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin[:, 0], ref_sin[0, :, :8], atol=1e-6, rtol=1e-6)
    same = positions[1]
    q, k = x.clone(), x.clone()
    q3, _ = rotary.at(same.expand(3, -1)).rotate_qk(q, k)
    q1, _ = rotary.at(same).rotate_qk(x.clone(), x.clone())
    assert torch.equal(q3, q1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_triton_backend_matches_the_cpu_reference(ckpt, ours) -> None:
    """On a GPU the fused Triton rotary + KV write rotates with the per-pass M-RoPE table."""
    from llmfleet.models.loader import load_model

    cuda = load_model(ckpt, dtype=torch.float32, device="cuda").model
    prompts = [_inputs(ckpt, *PROMPTS[name]) for name in PROMPTS]
    cpu_logits, cpu_tokens = _run_ours(ours, prompts)
    gpu_logits, gpu_tokens = _run_ours(cuda, prompts)
    for ours_cpu, ours_gpu in zip(cpu_logits, gpu_logits, strict=True):
        # float32 on both, but the Triton kernels' float32 dots run in TF32 on the GPU (about
        # 1e-3 of the logits' scale here); a wrong M-RoPE table would be off by O(1).
        scale = ours_cpu.abs().max().item()
        torch.testing.assert_close(ours_gpu, ours_cpu, atol=3e-3 * max(scale, 1.0), rtol=3e-3)
    assert gpu_tokens == cpu_tokens
