"""A vision-language model's image preprocessing: its HF image processor (resize, normalise,
patchify; Pillow backends) and its placeholder rule, read from the checkpoint directory.

    proc = load_image_processor("/ckpt")          # None for a text-only model
    pixel = proc.preprocess(pil_image)            # PixelInput of this one image
    n = proc.num_tokens(pixel)                    # its placeholder tokens in the prompt

`PixelInput.pixel_values` is exactly what the HF image processor returns for the image alone,
as float32 (LLaVA: (1, 3, H, W); Qwen2-VL: (patches, C*T*P*P) with grid = image_grid_thw (t, h,
w)). Placeholder counts follow the HF processors: LLaVA (H // patch)(W // patch) +
num_additional_image_tokens, less one with the "default" feature strategy (the class token
dropped); Qwen2-VL t*h*w // merge_size^2.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmfleet.shared.core.errors import ModelLoadError
from llmfleet.shared.core.multimodal import PixelInput, content_hash

logger = logging.getLogger(__name__)

FAMILIES = {"llava": "llava", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"}


@dataclass(frozen=True)
class PlaceholderRule:
    """How many placeholder tokens an image becomes, and which token texts a prompt's text may
    not contain (they would pass for placeholders)."""

    family: str  # "llava" or "qwen2_vl"
    image_token_id: int
    image_token: str
    reserved_texts: tuple[str, ...]  # the image token and the vision delimiters
    patch_size: int = 0  # llava
    num_additional_image_tokens: int = 0  # llava: the class token (CLIP: 1)
    drop_first_token: bool = False  # llava "default" strategy
    merge_size: int = 1  # qwen2_vl

    def num_tokens(self, pixel: PixelInput) -> int:
        if self.family == "qwen2_vl":
            t, h, w = pixel.grid
            return t * h * w // self.merge_size**2
        height, width = pixel.pixel_values.shape[-2:]
        n = (height // self.patch_size) * (width // self.patch_size)
        return n + self.num_additional_image_tokens - (1 if self.drop_first_token else 0)


class ImageProcessor:
    """The HF image processor of one checkpoint plus its `PlaceholderRule`. Thread-safe: calls
    keep no state (the tokenizer service preprocesses on worker threads)."""

    def __init__(self, hf_processor: Any, rule: PlaceholderRule) -> None:
        self.hf = hf_processor
        self.rule = rule

    @property
    def image_token_id(self) -> int:
        return self.rule.image_token_id

    def preprocess(self, image: Any) -> PixelInput:
        """The PixelInput of one PIL image (float32, contiguous)."""
        out = self.hf(images=[image], return_tensors="pt")
        pixel_values = out["pixel_values"].to(torch.float32).contiguous()
        grid: tuple[int, ...] = ()
        if self.rule.family == "qwen2_vl":
            grid = tuple(int(g) for g in out["image_grid_thw"][0].tolist())
        return PixelInput(pixel_values, grid)

    def num_tokens(self, pixel: PixelInput) -> int:
        return self.rule.num_tokens(pixel)

    def num_tokens_for_size(self, width: int, height: int) -> int:
        """Placeholder tokens of a width x height image, without preprocessing it (what the
        gateway counts for a prompt's length): Qwen2-VL's resize rule, LLaVA's fixed size."""
        if self.rule.family == "qwen2_vl":
            try:
                patches = self.hf.get_number_of_image_patches(height, width, {})
            except ValueError:  # an aspect ratio the processor refuses: so will Tokenize
                return 1
            return int(patches) // self.rule.merge_size**2
        return self._fixed_num_tokens

    def max_num_tokens(self) -> int:
        """The most placeholder tokens one image may become."""
        if self.rule.family == "qwen2_vl":
            max_pixels = getattr(self.hf, "max_pixels", None) or self.hf.size["longest_edge"]
            patch = self.hf.patch_size
            return int(max_pixels) // (patch * patch * self.rule.merge_size**2)
        return self._fixed_num_tokens

    @functools.cached_property
    def _fixed_num_tokens(self) -> int:
        from PIL import Image

        return self.num_tokens(self.preprocess(Image.new("RGB", (32, 32))))


def pixel_hash(pixel: PixelInput) -> str:
    """The content hash of a preprocessed image (shared/core/multimodal.content_hash)."""
    t = pixel.pixel_values.contiguous()
    return content_hash(str(t.dtype), tuple(t.shape), t.numpy().tobytes())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: {e}") from None


def vision_family(model_dir: Path) -> str | None:
    """ "llava" or "qwen2_vl" for a supported VLM checkpoint; None for a text-only model.
    ModelLoadError for a vision model of another family."""
    config = _read_json(model_dir / "config.json")
    if "vision_config" not in config:
        return None
    model_type = config.get("model_type", "")
    if model_type not in FAMILIES:
        raise ModelLoadError(f"{model_dir}: vision model type {model_type!r} is not supported")
    return FAMILIES[model_type]


def load_image_processor(model: str | None, tokenizer: Any) -> ImageProcessor | None:
    """The image processor of `model` (a checkpoint directory), None when it takes no images
    (a text-only directory, a .gguf file, the bundled model)."""
    from llmfleet.models.checkpoint_files import resolve_model_path

    path = resolve_model_path(model)
    if not path.is_dir():
        return None
    family = vision_family(path)
    if family is None:
        return None
    from transformers import AutoImageProcessor

    try:
        hf = AutoImageProcessor.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: no usable image processor config: {e}") from None
    config = _read_json(path / "config.json")
    if family == "llava":
        rule = _llava_rule(path, config, tokenizer)
    else:
        rule = _qwen2_vl_rule(config, hf, tokenizer)
    logger.info("image processor %s for %s (%s)", type(hf).__name__, path, family)
    return ImageProcessor(hf, rule)


def _token_text(tokenizer: Any, token_id: int) -> str:
    text = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(text, str):
        raise ModelLoadError(f"the tokenizer has no token {token_id}")
    return text


def _llava_rule(path: Path, config: dict[str, Any], tokenizer: Any) -> PlaceholderRule:
    proc = _read_json(path / "processor_config.json")
    vision = config.get("vision_config", {})
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if token_id is None:
        raise ModelLoadError(f"{path}: config.json names no image_token_index")
    patch = proc.get("patch_size") or vision.get("patch_size")
    if not patch:
        raise ModelLoadError(f"{path}: no patch_size in processor_config.json or vision_config")
    strategy = proc.get("vision_feature_select_strategy") or config.get(
        "vision_feature_select_strategy", "default"
    )
    if "num_additional_image_tokens" in proc:
        extra = int(proc["num_additional_image_tokens"])
    else:  # CLIP-style towers prepend a class token, SigLIP has none
        extra = 1 if vision.get("model_type", "clip_vision_model").startswith("clip") else 0
    token = _token_text(tokenizer, token_id)
    return PlaceholderRule(
        family="llava",
        image_token_id=int(token_id),
        image_token=token,
        reserved_texts=(token,),
        patch_size=int(patch),
        num_additional_image_tokens=extra,
        drop_first_token=strategy == "default",
    )


def _qwen2_vl_rule(config: dict[str, Any], hf: Any, tokenizer: Any) -> PlaceholderRule:
    token_id = int(config["image_token_id"])
    merge = getattr(hf, "merge_size", None) or config["vision_config"].get("spatial_merge_size", 2)
    reserved = [_token_text(tokenizer, token_id)]
    for key in ("vision_start_token_id", "vision_end_token_id", "video_token_id"):
        if config.get(key) is not None:
            reserved.append(_token_text(tokenizer, config[key]))
    return PlaceholderRule(
        family="qwen2_vl",
        image_token_id=token_id,
        image_token=reserved[0],
        reserved_texts=tuple(reserved),
        merge_size=int(merge),
    )
