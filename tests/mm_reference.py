"""transformers as the reference for image prompts: the tiny vision-language checkpoints
(mm_checkpoints/), their HF processors and greedy `generate`, and the same prompts as the
engine takes them (token ids, `ImageRef`s, `PixelInput`s).

    ckpt = checkpoint("qwen2_vl")
    proc = processed("qwen2_vl", ckpt, prompt_text("qwen2_vl", 2), [image(1), image(2, wide)])
    ids, images, pixels = engine_inputs("qwen2_vl", ckpt, proc)
    want = hf_greedy("qwen2_vl", ckpt, proc, steps=8)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from PIL import Image

from llmfleet.shared.core.multimodal import ImageRef, PixelInput, content_hash

FAMILIES = ("llava", "qwen2_vl")
IMAGE_TOKEN_IDS = {"llava": 259, "qwen2_vl": 261}
# (width, height) of the images each family's prompts use: LLaVA resizes to 28x28 anyway;
# Qwen2-VL keeps the size (56x56: 4 placeholders, 112x84: 12).
SIZES = {"llava": [(28, 28), (40, 32)], "qwen2_vl": [(56, 56), (112, 84)]}


def checkpoint(family: str) -> str:
    if family == "llava":
        from mm_checkpoints.llava import make_llava_checkpoint

        return make_llava_checkpoint("clip")
    from mm_checkpoints.qwen2_vl import make_qwen2_vl_checkpoint

    return make_qwen2_vl_checkpoint()


def image(seed: int, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A random RGB image of `size` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def prompt_text(family: str, num_images: int, question: str = "What is this?") -> str:
    """A chat prompt as the family's template renders it, one image placeholder per image."""
    if family == "llava":
        return "USER: " + "<image>\n" * num_images + question + " ASSISTANT:"
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{vision}{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def processed(family: str, ckpt: str, text: str, images: list[Image.Image]) -> dict[str, Any]:
    """The HF processor's output for one prompt (placeholders expanded, pixel values)."""
    if family == "llava":
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(ckpt)
        return dict(proc(text=[text], images=images or None, return_tensors="pt"))
    from mm_checkpoints.qwen2_vl import processor_inputs

    return processor_inputs(ckpt, text, images)


def pixel_inputs(family: str, proc: dict[str, Any]) -> list[PixelInput]:
    """Each image's own slice of the processor's pixel_values (the tokenizer service's)."""
    if "pixel_values" not in proc:
        return []
    pv = proc["pixel_values"]
    if family == "llava":
        return [PixelInput(pv[i : i + 1].clone()) for i in range(pv.shape[0])]
    out, at = [], 0
    for grid in proc["image_grid_thw"].tolist():
        n = grid[0] * grid[1] * grid[2]
        out.append(PixelInput(pv[at : at + n].clone(), tuple(grid)))
        at += n
    return out


def image_hash(p: PixelInput) -> str:
    t = p.pixel_values.contiguous()
    return content_hash(str(t.dtype), tuple(t.shape), t.numpy().tobytes())


def engine_inputs(
    family: str, proc: dict[str, Any]
) -> tuple[list[int], tuple[ImageRef, ...], dict[str, PixelInput]]:
    """(prompt token ids, the images' placeholder runs, pixels by content hash)."""
    ids = proc["input_ids"][0].tolist()
    token = IMAGE_TOKEN_IDS[family]
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token and (i == 0 or ids[i - 1] != token):
            runs.append((i, 1))
        elif t == token:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
    pixels = pixel_inputs(family, proc)
    assert len(runs) == len(pixels), (runs, len(pixels))
    refs = tuple(
        ImageRef(image_hash(p), offset, length, p.grid)
        for (offset, length), p in zip(runs, pixels, strict=True)
    )
    return ids, refs, {r.content_hash: p for r, p in zip(refs, pixels, strict=True)}


@functools.cache
def hf_model(ckpt: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_greedy(ckpt: str, proc: dict[str, Any], steps: int) -> list[int]:
    """transformers' greedy tokens after the prompt (`steps` of them, eos ignored)."""
    model = hf_model(ckpt)
    with torch.inference_mode():
        out = model.generate(
            **proc,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, proc["input_ids"].shape[1] :].tolist()
