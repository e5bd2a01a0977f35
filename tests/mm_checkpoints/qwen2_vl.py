"""A tiny random-weight Qwen2-VL checkpoint, written as transformers writes a real one.

Layout: config.json (Qwen2VLForConditionalGeneration, nested text/vision configs),
model.safetensors (float32), the byte-level tokenizer of tiny_models.py plus the vision
specials, Qwen2-VL's chat template (an image part renders as
`<|vision_start|><|image_pad|><|vision_end|>`), and preprocessor_config.json for
Qwen2VLImageProcessor with small pixel bounds: a 56x56 image is a (1, 4, 4) patch grid, 4
placeholder tokens; a 112x84 image (1, 8, 6), 12 tokens. `AutoProcessor.from_pretrained(dir)`
expands each `<|image_pad|>` to t*h*w / merge^2 tokens where torchvision is installed (its
Qwen2VLProcessor insists on a video processor, which needs torchvision); without it,
`processor_inputs` below does that processor's job from the image processor and tokenizer
(where both run, their outputs are equal).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tiny_models import SPECIALS, make_tokenizer
from tokenizers import AddedToken

VISION_SPECIALS = {
    "<|vision_start|>": 259,
    "<|vision_end|>": 260,
    "<|image_pad|>": 261,
    "<|video_pad|>": 262,
}
VOCAB = 264  # 256 bytes, tiny_models' specials, the vision specials, one spare row
IMAGE_TOKEN_ID = VISION_SPECIALS["<|image_pad|>"]
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

# Qwen2-VL-Instruct's template (the hub's chat_template.json), verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 16: 8 rotary frequencies, split t/h/w as 2/3/3
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    initializer_range=0.1,  # with the vision tower's 0.3: different images, different tokens
)
VISION_CONFIG: dict[str, Any] = dict(
    depth=2,
    embed_dim=32,
    num_heads=2,
    mlp_ratio=2,
    hidden_size=64,  # the text hidden size: the merger projects into it
    in_channels=3,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=TEMPORAL,
    initializer_range=0.3,
)
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
}


def make_qwen2_vl_tokenizer() -> Any:
    tok = make_tokenizer()
    specials = [AddedToken(t, special=True, normalized=False) for t in VISION_SPECIALS]
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *specials]})
    ids = tok.convert_tokens_to_ids(list(VISION_SPECIALS))
    if ids != list(VISION_SPECIALS.values()) or len(SPECIALS) != 3:
        raise RuntimeError(
            f"vision specials got ids {ids}, expected {list(VISION_SPECIALS.values())}"
        )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_hf_qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(TEXT_CONFIG),
        vision_config=dict(VISION_CONFIG),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VISION_SPECIALS["<|video_pad|>"],
        vision_start_token_id=VISION_SPECIALS["<|vision_start|>"],
        vision_end_token_id=VISION_SPECIALS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        # Random init leaves norms at 1 and biases at 0; perturb every 1-D parameter so each
        # weight matters in the tests.
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_qwen2_vl_checkpoint(out: Path) -> Path:
    build_hf_qwen2_vl().save_pretrained(out)
    tok = make_qwen2_vl_tokenizer()
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def processor_inputs(ckpt: str, text: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """What Qwen2VLProcessor(text=[text], images=images) returns: each `<|image_pad|>` of the
    rendered `text` expanded to its image's t*h*w / merge^2 tokens; input_ids (1, L),
    attention_mask, mm_token_type_ids (1 on image tokens), pixel_values (patches, C*T*P*P),
    image_grid_thw (num_images, 3)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    out: dict[str, torch.Tensor] = {}
    parts = text.split("<|image_pad|>")
    if len(parts) != len(images) + 1:
        raise ValueError(f"{len(parts) - 1} image placeholders for {len(images)} images")
    expanded = parts[0]
    if images:
        out.update(AutoImageProcessor.from_pretrained(ckpt)(images=images, return_tensors="pt"))
        for grid, part in zip(out["image_grid_thw"].tolist(), parts[1:], strict=True):
            expanded += "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // MERGE**2) + part
    ids = tok(expanded, return_tensors="pt")["input_ids"]
    out["input_ids"] = ids
    out["attention_mask"] = torch.ones_like(ids)
    out["mm_token_type_ids"] = (ids == IMAGE_TOKEN_ID).int()
    return out


@functools.cache
def make_qwen2_vl_checkpoint() -> str:
    """The checkpoint directory; written once per process, removed when it exits."""
    out = Path(tempfile.mkdtemp(prefix="llmfleet-qwen2vl-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(save_qwen2_vl_checkpoint(out))
