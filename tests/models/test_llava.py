"""LLaVA (CLIP and SigLIP towers) against transformers: prefill logits and greedy tokens for
prompts of 0, 1 and 2 images, driven step by step over a paged KV cache the way the engine
drives a vision-language model (embed, overwrite placeholder rows, forward with
inputs_embeds); the encoder's batching and placeholder counts; the loader's VLM paths."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from mm_checkpoints.llava import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, make_llava_checkpoint
from PIL import Image
from tiny_models import BLOCK_SIZE, Runner, assert_logits_close
from transformers import AutoModelForImageTextToText, AutoProcessor

from llmfleet.engine.flops import model_shape
from llmfleet.models.architectures import text_model_class
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import LoadedModel, build_model, load_model, load_simulated
from llmfleet.models.multimodal import MultimodalCausalLM
from llmfleet.shared.core.errors import ModelLoadError
from llmfleet.shared.core.multimodal import PixelInput

STEPS = 6
IMAGE = {"type": "image"}
MESSAGES = [  # prompts of 0, 1 and 2 images
    [{"type": "text", "text": "Say hi."}],
    [{"type": "text", "text": "What is "}, IMAGE, {"type": "text", "text": "?"}],
    [IMAGE, {"type": "text", "text": " or "}, IMAGE, {"type": "text", "text": " then?"}],
]


def random_images(n: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(40, 50), (64, 32), (28, 28), (33, 61)]
    return [
        Image.fromarray(rng.integers(0, 256, (*sizes[i % 4], 3), dtype=np.uint8)) for i in range(n)
    ]


class Case:
    """One checkpoint: our model, transformers' and the processor, with the encoded prompts."""

    def __init__(self, vision: str) -> None:
        self.path = make_llava_checkpoint(vision)
        self.loaded = load_model(self.path, progress=False)
        self.model: Any = self.loaded.model
        self.hf = AutoModelForImageTextToText.from_pretrained(self.path, dtype=torch.float32)
        self.hf.eval()
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.inputs = []
        seed = 0
        for content in MESSAGES:
            text = self.processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            images = random_images(sum(p is IMAGE for p in content), seed) or None
            seed += 1
            self.inputs.append(self.processor(text=text, images=images, return_tensors="pt"))

    def prompt(self, i: int) -> list[int]:
        return self.inputs[i]["input_ids"][0].tolist()

    def pixels(self, i: int) -> list[PixelInput]:
        pv = self.inputs[i].get("pixel_values")
        return [] if pv is None else [PixelInput(pv[j : j + 1]) for j in range(pv.shape[0])]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def case(request: pytest.FixtureRequest) -> Case:
    return Case(request.param)


def placeholder_offsets(ids: list[int]) -> list[int]:
    """Start of each image's placeholder run (the test prompts never put two runs together)."""
    return [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != t)]


def chunk_embeds(
    model: MultimodalCausalLM,
    ids: list[int],
    features: list[torch.Tensor],
    start: int,
    end: int,
) -> torch.Tensor:
    """Input embeddings of prompt tokens [start, end): token embeddings with the rows of each
    image's placeholders that fall in the chunk replaced by its feature rows."""
    emb = model.embed_input_ids(torch.tensor(ids[start:end]))
    for offset, feats in zip(placeholder_offsets(ids), features, strict=True):
        lo, hi = max(offset, start), min(offset + feats.shape[0], end)
        if lo < hi:
            emb[lo - start : hi - start] = feats[lo - offset : hi - offset]
    return emb


class MMRunner(Runner):
    @torch.no_grad()
    def step_embeds(
        self, chunks: list[list[int]], starts: list[int], embeds: torch.Tensor | None
    ) -> list[torch.Tensor]:
        qlens = [len(c) for c in chunks]
        slens = [s + q for s, q in zip(starts, qlens, strict=True)]
        meta = AttentionMetadata.build(qlens, slens, self.tables, BLOCK_SIZE)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens, strict=True)])
        hidden = self.model(ids, pos, self.kv, meta, inputs_embeds=embeds)
        return list(self.model.compute_logits(hidden).split(qlens))


def hf_reference(case: Case, i: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' prefill logits (len, V) and greedy tokens (stopping at EOS) of prompt i."""
    enc = case.inputs[i]
    with torch.no_grad():
        logits = case.hf(**enc).logits[0].float()
        out = case.hf.generate(**enc, do_sample=False, max_new_tokens=STEPS)
    return logits, out[0, enc["input_ids"].shape[1] :].tolist()


def test_batched_prefill_and_greedy_decode_match_transformers(case: Case) -> None:
    model = case.model
    prompts = [case.prompt(i) for i in range(len(MESSAGES))]
    pixels = [case.pixels(i) for i in range(len(MESSAGES))]
    assert [len(p) for p in pixels] == [0, 1, 2]
    with torch.no_grad():  # one encoder run for the step's three images
        flat = model.encode_images([p for ps in pixels for p in ps])
    features = [flat[:0], flat[:1], flat[1:3]]
    runner = MMRunner(case.loaded, [len(p) + STEPS for p in prompts])
    with torch.no_grad():
        embeds = torch.cat(
            [chunk_embeds(model, p, f, 0, len(p)) for p, f in zip(prompts, features, strict=True)]
        )
    logits = runner.step_embeds(prompts, [0, 0, 0], embeds)
    tokens = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(STEPS - 1):  # decode steps: plain token ids, no inputs_embeds
        starts = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        step = runner.step_embeds([[t[-1]] for t in tokens], starts, None)
        for t, lg in zip(tokens, step, strict=True):
            t.append(int(lg[-1].argmax()))
    for i in range(len(prompts)):
        ref_logits, ref_tokens = hf_reference(case, i)
        assert_logits_close(logits[i], ref_logits)
        assert ref_tokens, "transformers generated nothing"
        assert tokens[i][: len(ref_tokens)] == ref_tokens, f"prompt with {i} images"


def test_chunk_boundary_inside_a_placeholder_run(case: Case) -> None:
    model, ids = case.model, case.prompt(2)
    with torch.no_grad():
        features = model.encode_images(case.pixels(2))
    split = placeholder_offsets(ids)[0] + 2  # two of the first image's rows in each chunk
    runner = MMRunner(case.loaded, [len(ids)])
    got = []
    for start, end in ((0, split), (split, len(ids))):
        with torch.no_grad():
            emb = chunk_embeds(model, ids, features, start, end)
        got += runner.step_embeds([ids[start:end]], [start], emb)
    ref_logits, _ = hf_reference(case, 2)
    assert_logits_close(torch.cat(got), ref_logits)


def test_images_change_the_logits(case: Case) -> None:
    """Guards the comparison above: a different image gives different next-token logits."""
    model, ids = case.model, case.prompt(1)
    other = case.processor.image_processor(random_images(1, 99), return_tensors="pt")
    logits = []
    for pixels in (case.pixels(1), [PixelInput(other["pixel_values"])]):
        with torch.no_grad():
            emb = chunk_embeds(model, ids, model.encode_images(pixels), 0, len(ids))
        logits.append(MMRunner(case.loaded, [len(ids)]).step_embeds([ids], [0], emb)[0][-1])
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_encoder_batched_equals_one_at_a_time(case: Case) -> None:
    pv = case.processor.image_processor(random_images(2, 7), return_tensors="pt")["pixel_values"]
    images = [PixelInput(pv[0]), PixelInput(pv[1:2])]  # (C, S, S) and the processor's (1, ...)
    with torch.no_grad():
        batched = case.model.encode_images(images)
        single = [case.model.encode_images([im])[0] for im in images]
    assert len(batched) == 2
    for b, s in zip(batched, single, strict=True):
        torch.testing.assert_close(b, s, atol=1e-5, rtol=1e-5)
    assert case.model.encode_images([]) == []


def test_image_features_match_transformers(case: Case) -> None:
    pv = case.inputs[2]["pixel_values"]  # (2, C, S, S)
    with torch.no_grad():
        ref = case.hf.model.get_image_features(pv).pooler_output
        ours = case.model.encode_images(case.pixels(2))
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_rows_equal_the_processors_placeholder_count(case: Case) -> None:
    for i in range(len(MESSAGES)):
        pixels = case.pixels(i)
        with torch.no_grad():
            rows = [f.shape for f in case.model.encode_images(pixels)]
        assert rows == [(TOKENS_PER_IMAGE, 64)] * len(pixels)
        assert case.prompt(i).count(IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE * len(pixels)
    assert case.model.tokens_per_image == TOKENS_PER_IMAGE
    assert case.model.image_token_id == IMAGE_TOKEN_ID


def test_pixels_of_the_wrong_size_are_refused(case: Case) -> None:
    with pytest.raises(ValueError, match="image 1: pixel_values of shape"):
        case.model.encode_images([case.pixels(1)[0], PixelInput(torch.zeros(3, 14, 14))])


def test_loads_transformers_5_and_llava_hf_weight_names(case: Case) -> None:
    """The in-memory transformers-5 names (`model.vision_tower.*`, `model.language_model.*`)
    and llava-hf's (`vision_tower.vision_model.*`, `language_model.model.*`) load the same."""
    state = case.hf.state_dict()
    legacy = {}
    for name, t in state.items():
        name = name.replace("model.vision_tower.", "vision_tower.vision_model.")
        name = name.replace("model.language_model.", "language_model.model.")
        name = name.replace("model.multi_modal_projector.", "multi_modal_projector.")
        legacy[name.replace("lm_head.", "language_model.lm_head.")] = t
    pixels = case.pixels(2)
    with torch.no_grad():
        want = case.model.encode_images(pixels)
    for weights in (state, legacy):
        model: Any = build_model(case.loaded.model.config)
        model.load_weights(weights.items())
        with torch.no_grad():
            for got, ref in zip(model.encode_images(pixels), want, strict=True):
                torch.testing.assert_close(got, ref, atol=0, rtol=0)
        emb = model.language_model.embed_tokens.weight
        torch.testing.assert_close(emb, case.model.language_model.embed_tokens.weight)
    missing = {k: v for k, v in state.items() if "multi_modal_projector.linear_2.bias" not in k}
    with pytest.raises(ModelLoadError, match="multi_modal_projector.linear_2.bias"):
        build_model(case.loaded.model.config).load_weights(missing.items())


def test_spec_and_engine_shape_come_from_the_text_config(case: Case) -> None:
    spec = case.loaded.spec
    assert spec.architecture == "LlavaForConditionalGeneration"
    assert (spec.vocab_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (260, 2, 2, 16)
    assert (spec.max_model_len, spec.bos_token_id) == (256, 256)
    assert spec.eos_token_ids == (256, 258)  # config EOS, then the template's <|im_end|>
    shape = model_shape(case.model, kv_bytes=4)
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (2, 64, 260)
    simulated = load_simulated(case.path)  # simulated fleets read the same spec
    assert simulated.spec.vocab_size == 260 and IMAGE_TOKEN_ID not in simulated.model.ordinary_ids


def test_unsupported_text_decoder_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="text model type 'gemma'.*supported: llama"):
        text_model_class(SimpleNamespace(model_type="gemma"))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_bfloat16_and_dummy_loads_encode(load_format: str) -> None:
    path = make_llava_checkpoint("clip")
    loaded: LoadedModel = load_model(
        path, dtype=torch.bfloat16, progress=False, load_format=load_format
    )
    model: Any = loaded.model
    pv = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        feats = model.encode_images([PixelInput(pv[0]), PixelInput(pv[1])])
    assert [(f.shape, f.dtype) for f in feats] == [((4, 64), torch.bfloat16)] * 2
    assert all(torch.isfinite(f).all() for f in feats)
    if load_format == "auto":
        ref: Any = load_model(path, progress=False).model
        with torch.no_grad():
            want = ref.encode_images([PixelInput(pv[0])])[0]
        torch.testing.assert_close(feats[0].float(), want, atol=0.1 * want.abs().max(), rtol=0.05)
