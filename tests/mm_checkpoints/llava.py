"""Tiny random-weight LLaVA checkpoints: a CLIP or SigLIP vision tower, the gelu projector and
tiny_models' Llama decoder, saved by transformers with the processor files llava-hf ships
(`AutoProcessor.from_pretrained(dir)` loads a LlavaProcessor).

Images are 28x28 with 14x14 patches: 4 patches. CLIP adds a class token that the "default"
feature strategy drops, SigLIP has none ("full"): either way an image is 4 `<image>` tokens.
The tokenizer is tiny_models' byte-level one with `<image>` added (id 259, so the vocabulary
stays 260); its ChatML template renders `{"type": "image"}` parts as `<image>` and text parts
as their text, in order.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tiny_models import _COMMON, SPECIALS, VOCAB, bytes_to_unicode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    SiglipImageProcessor,
    SiglipVisionConfig,
)

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 259
IMAGE_SIZE = 28
PATCH_SIZE = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 4, class token dropped or absent
VISIONS = ("clip", "siglip")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    num_channels=3,
)
_MEAN, _STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]


def make_llava_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update(SPECIALS)
    vocab[IMAGE_TOKEN] = IMAGE_TOKEN_ID
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", IMAGE_TOKEN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llava_config(vision: str) -> LlavaConfig:
    if vision == "clip":
        vision_config: Any = CLIPVisionConfig(**_VISION)
        strategy = "default"
    elif vision == "siglip":
        vision_config = SiglipVisionConfig(**_VISION)
        strategy = "full"
    else:
        raise ValueError(f"vision tower {vision!r}: one of {VISIONS}")
    return LlavaConfig(
        vision_config=vision_config,
        text_config=LlamaConfig(**_COMMON),
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=TOKENS_PER_IMAGE,
        projector_hidden_act="gelu",
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )


def build_hf_llava(vision: str) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(llava_config(vision)).to(torch.float32)
    with torch.no_grad():
        # Random init leaves norms at 1 and biases at 0; perturb them so every weight matters.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "multi_modal_projector" in name or "vision_tower" in name:
                # Larger vision-side weights, so image features move the decoder's logits.
                p.mul_(4.0)
    return model.eval()


def make_llava_processor(vision: str) -> LlavaProcessor:
    if vision == "clip":
        image_processor: Any = CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_mean=_MEAN,
            image_std=_STD,
        )
        extra, strategy = 1, "default"
    else:
        image_processor = SiglipImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=_MEAN, image_std=_STD
        )
        extra, strategy = 0, "full"
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=make_llava_tokenizer(),
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=extra,
        chat_template=CHAT_TEMPLATE,
    )


def write_llava_checkpoint(vision: str, out: Path) -> Path:
    """Save a tiny LLaVA (`vision` tower) with its processor into `out`."""
    build_hf_llava(vision).save_pretrained(out)
    make_llava_processor(vision).save_pretrained(out)
    return out


@functools.cache
def make_llava_checkpoint(vision: str = "clip") -> str:
    """A tiny LLaVA checkpoint directory with a `vision` ("clip" or "siglip") tower; written
    once per test process, removed when it exits."""
    out = Path(tempfile.mkdtemp(prefix=f"llmfleet-llava-{vision}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(write_llava_checkpoint(vision, out))
