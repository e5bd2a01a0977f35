"""Image preprocessing throughput of the tokenizer service on this CPU: images/s.

    python3 benchmarks/mm_preprocess_bench.py [--images 64 --concurrency 1 4 16]
    python3 benchmarks/mm_preprocess_bench.py --images 8 --concurrency 2    # a smoke run

Two processor configurations, written to a temporary model directory each (config.json, the
HF preprocessor config, a byte-level tokenizer with the image specials and a ChatML template;
no weights: the tokenizer service reads none):

  qwen2-vl-7b   Qwen2VLImageProcessor, patch 14, merge 2, temporal 2, default min/max pixels
                (a 640x480 image is a (1, 34, 46) grid: 391 tokens, 1564 patch rows)
  llava-336     CLIPImageProcessor 336 (resize, center crop), LLaVA-1.5's 576 tokens

for 640x480 photos-like images (smooth gradients plus noise) encoded as JPEG and PNG, each
image distinct (a cache would not help). Two ways:

  in-process   load_image + the image processor + content hash per image, one thread
               (text/media.py, text/image_processing.py): the CPU cost of one image
  service      chat Tokenize calls with one image each (a data: URI) to a tokenizer service
               started as its own process (`python -m llmfleet.services.tokenizer`), from
               `--concurrency` concurrent callers: what the service sustains end to end
               (gRPC, base64, decode, processor, hash, chat template, media store)

Prints one table row per (config, format, way, concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llmfleet.shared.core.image_source import ImageSource
from llmfleet.text.image_processing import load_image_processor, pixel_hash
from llmfleet.text.loading import load_tokenizer
from llmfleet.text.media import MediaPolicy, load_image
from llmfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
IDS = {s: 256 + i for i, s in enumerate(SPECIALS)}
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2-vl-7b": {
        "placeholder": "<|vision_start|><|image_pad|><|vision_end|>",
        "config": {
            "model_type": "qwen2_vl",
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "image_token_id": IDS["<|image_pad|>"],
            "video_token_id": IDS["<|video_pad|>"],
            "vision_start_token_id": IDS["<|vision_start|>"],
            "vision_end_token_id": IDS["<|vision_end|>"],
            "vision_config": {"patch_size": 14, "spatial_merge_size": 2},
        },
        "preprocessor": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_mean": MEAN,
            "image_std": STD,
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 16384,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },
        "processor": None,
    },
    "llava-336": {
        "placeholder": "<image>",
        "config": {
            "model_type": "llava",
            "architectures": ["LlavaForConditionalGeneration"],
            "image_token_index": IDS["<image>"],
            "vision_feature_select_strategy": "default",
            "vision_config": {
                "model_type": "clip_vision_model",
                "patch_size": 14,
                "image_size": 336,
            },
        },
        "preprocessor": {
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": 336},
            "crop_size": {"height": 336, "width": 336},
            "do_center_crop": True,
            "image_mean": MEAN,
            "image_std": STD,
        },
        "processor": {
            "processor_class": "LlavaProcessor",
            "patch_size": 14,
            "num_additional_image_tokens": 1,
            "vision_feature_select_strategy": "default",
        },
    },
}


def write_model_dir(name: str, root: Path) -> str:
    spec = CONFIGS[name]
    out = root / name
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(spec["config"]))
    (out / "preprocessor_config.json").write_text(json.dumps(spec["preprocessor"]))
    if spec["processor"] is not None:
        (out / "processor_config.json").write_text(json.dumps(spec["processor"]))
    vocab = {_byte_char(b): b for b in range(256)} | IDS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
        + spec["placeholder"]
        + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    return str(out)


def _byte_char(b: int) -> str:
    """GPT-2's byte-level alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def images(count: int, fmt: str) -> list[bytes]:
    """Distinct 640x480 photo-like images (gradients plus noise), encoded as `fmt`."""
    out = []
    yy, xx = np.mgrid[0:480, 0:640]
    for i in range(count):
        rng = np.random.RandomState(i)
        base = np.stack([(xx * (i + 1)) % 256, (yy * 2 + i) % 256, (xx + yy) % 256], axis=-1)
        noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype("uint8")
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buf.getvalue())
    return out


def in_process(model: str, raws: list[bytes]) -> tuple[float, int]:
    """(images/s, tokens per image) of load + processor + hash on this thread."""
    processor = load_image_processor(model, load_tokenizer(model))
    assert processor is not None
    policy = MediaPolicy()
    processor.preprocess(load_image(ImageSource(data=raws[0]), policy, "warmup"))
    start = time.perf_counter()
    tokens = 0
    for raw in raws:
        pixel = processor.preprocess(load_image(ImageSource(data=raw), policy, "image"))
        pixel_hash(pixel)
        tokens = processor.num_tokens(pixel)
    return len(raws) / (time.perf_counter() - start), tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(model: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmfleet.services.tokenizer", "--model", model]
    cmd += ["--port", str(port), "--metrics-port", "0", "--max-image-bytes", str(64 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the tokenizer exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the tokenizer did not start")
            time.sleep(0.1)


def request(raw: bytes, fmt: str) -> tokenizer_pb2.TokenizeRequest:
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(raw).decode()}"
    parts = [
        common_pb2.ContentPart(image=common_pb2.ImageInput(url=url)),
        common_pb2.ContentPart(text="What is in this picture?"),
    ]
    chat = common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(role="user", parts=parts)])
    return tokenizer_pb2.TokenizeRequest(chat=chat)


async def through_service(address: str, raws: list[bytes], fmt: str, concurrency: int) -> float:
    """images/s of one-image Tokenize calls from `concurrency` callers."""
    requests = [request(raw, fmt) for raw in raws]
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        await stub.Tokenize(requests[0])  # warm up
        queue = list(reversed(requests))

        async def caller() -> None:
            while queue:
                response = await stub.Tokenize(queue.pop(), timeout=300)
                assert len(response.images) == 1

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return len(requests) / (time.perf_counter() - start)


ROW = "{:<12} {:<6} {:<11} {:>7} {:>9} {:>9} {:>6}"


def row(name: str, fmt: str, way: str, callers: int, rate: float, tokens: int) -> str:
    return ROW.format(name, fmt, way, callers, f"{rate:.1f}", f"{1000 / rate:.1f}", tokens)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=64, help="distinct images per measurement")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--formats", nargs="+", default=["JPEG", "PNG"], choices=["JPEG", "PNG"])
    args = p.parse_args()
    print(f"cpu: {os.cpu_count()} cores; {args.images} distinct 640x480 images per row")
    print(ROW.format("config", "format", "way", "callers", "images/s", "ms/image", "tokens"))
    print("-" * 66)
    with tempfile.TemporaryDirectory(prefix="llmfleet-mmbench-") as tmp:
        for name in args.configs:
            model = write_model_dir(name, Path(tmp))
            proc, address = start_service(model)
            try:
                for fmt in args.formats:
                    raws = images(args.images, fmt)
                    rate, tokens = in_process(model, raws)
                    print(row(name, fmt, "in-process", 1, rate, tokens))
                    for c in args.concurrency:
                        rate = asyncio.run(through_service(address, raws, fmt, c))
                        print(row(name, fmt, "service", c, rate, tokens))
            finally:
                proc.terminate()
                proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
