"""Qwen2-VL vision encoder throughput: images encoded in one batched call vs one at a time.

    python3 benchmarks/mm_encoder_bench.py [--images-per-request 4 --requests 8 --size 448]
    python3 benchmarks/mm_encoder_bench.py --device cpu --shape tiny     # a smoke run

A Qwen2-VL-7B-shape vision tower (depth 32, embed 1280, 16 heads, mlp ratio 4, patch 14,
merge 2, merger to 3584) with random weights (N(0, 0.02), LayerNorms 1 / 0) in `--dtype`,
inside our `Qwen2VLForConditionalGeneration` (with a one-layer text decoder, which the encoder
never touches). Each of `--requests` requests carries `--images-per-request` images of
`--size` x `--size` pixels (448: a (1, 32, 32) patch grid, 256 tokens per image), given as
the image processor's pixel rows (random values: preprocessing is mm_preprocess_bench.py's).
Three ways to encode the same images, each timed as the median of `--iters` passes:

  one-by-one   encode_images([image]) per image (an encoder that batches nothing)
  per-request  encode_images(one request's images)
  batched      encode_images(every request's images) in one call (what a worker step does)

Before timing, a float32 check at the tiny shape with images of different grids: the batched
call must give each image the rows it gets alone (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import Qwen2VLConfig

from llmfleet.models.qwen2_vl import Qwen2VLForConditionalGeneration
from llmfleet.shared.core.multimodal import PixelInput

SHAPES: dict[str, dict[str, Any]] = {
    "7b": dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=3584),
    "tiny": dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64),
}
PATCH, MERGE, TEMPORAL = 14, 2, 2


def build(shape: str, dtype: torch.dtype, device: str) -> Qwen2VLForConditionalGeneration:
    vision = dict(
        SHAPES[shape], patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL
    )
    hidden = vision["hidden_size"]
    heads = hidden // 128 if hidden >= 128 else 4
    half = hidden // heads // 2  # rotary pairs per head, split t/h/w as Qwen2-VL's 16/24/24
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text = dict(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=1,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
    )
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=1000)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def images(n: int, size: int, device: str, dtype: torch.dtype, seed: int) -> list[PixelInput]:
    side = size // PATCH
    grid = (1, side, side)
    gen = torch.Generator(device=device).manual_seed(seed)
    rows, width = side * side, 3 * TEMPORAL * PATCH * PATCH
    return [
        PixelInput(torch.randn(rows, width, generator=gen, device=device).to(dtype), grid)
        for _ in range(n)
    ]


def check_batched_equals_single(device: str) -> float:
    """Max |batched - alone| over images of three grids, float32, tiny shape."""
    model = build("tiny", torch.float32, device)
    gen = torch.Generator(device=device).manual_seed(1)
    grids = [(1, 4, 4), (1, 6, 8), (1, 4, 4), (1, 8, 6)]
    pixels = [
        PixelInput(
            torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=gen, device=device),
            (t, h, w),
        )
        for t, h, w in grids
    ]
    with torch.no_grad():
        batched = model.encode_images(pixels)
        alone = [model.encode_images([p])[0] for p in pixels]
    return max((b - a).abs().max().item() for b, a in zip(batched, alone, strict=True))


def timed(fn: Callable[[], None], iters: int, device: str) -> float:
    """Median seconds of `fn` over `iters` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=list(SHAPES), default="7b")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--images-per-request", type=int, default=4)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (x 28)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if args.size % (PATCH * MERGE):
        ap.error(f"--size must be a multiple of {PATCH * MERGE}")
    dtype = getattr(torch, args.dtype)

    err = check_batched_equals_single(args.device)
    print(f"check: float32 batched vs one at a time, max |diff| {err:.2e}")
    if err > 1e-4:
        print("FAILED: batched encoding differs from one image at a time")
        sys.exit(1)

    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    model = build(args.shape, dtype, args.device)
    k, r = args.images_per_request, args.requests
    reqs = [images(k, args.size, args.device, dtype, seed=i) for i in range(r)]
    every = [im for req in reqs for im in req]
    grid = every[0].grid
    tokens = grid[1] * grid[2] // MERGE**2
    print(
        f"shape {args.shape} {args.dtype} on {args.device}: {r} requests x {k} images of "
        f"{args.size}x{args.size} (grid {grid}, {tokens} tokens each)"
    )

    def one_by_one() -> None:
        for im in every:
            model.encode_images([im])

    def per_request() -> None:
        for req in reqs:
            model.encode_images(req)

    def batched() -> None:
        model.encode_images(every)

    results = {}
    with torch.no_grad():
        for name, fn in (
            ("one-by-one", one_by_one),
            ("per-request", per_request),
            ("batched", batched),
        ):
            results[name] = timed(fn, args.iters, args.device)
    base = results["one-by-one"]
    print(f"{'mode':<12} {'ms/pass':>10} {'images/s':>10} {'vs one-by-one':>14}")
    for name, sec in results.items():
        print(f"{name:<12} {sec * 1e3:>10.1f} {len(every) / sec:>10.1f} {base / sec:>13.2f}x")


if __name__ == "__main__":
    main()
