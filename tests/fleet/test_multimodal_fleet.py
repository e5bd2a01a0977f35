"""Images through real fleets (separate processes on loopback) against transformers.

Both tiny checkpoints, LLaVA (CLIP tower) and Qwen2-VL (M-RoPE), each in an aggregated fleet
(one unified worker) and a disaggregated one with a kvstore, where an n=1 request goes through
the KV lease (the prefill worker fetches the pixels from the tokenizer's media store and encodes
them, the decode worker gets the ImageRefs for its block hashes and M-RoPE positions only) and
an n=2 request is prefilled by the decode worker itself. Images go in as PNG bytes in chat
parts of the gRPC API; greedy tokens for 0, 1 and 2 images equal transformers' `generate`; the
same image again reports cached prompt tokens past it, a different image of the same size only
the text before.
"""

from __future__ import annotations

import io

import pytest
from mm_reference import SIZES, checkpoint, engine_inputs, hf_greedy, image, processed

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.client.generation import GenerationClient
from llmfleet.shared.core.image_source import ImageSource

BLOCK = 8
STEPS = 6
QUESTION = "What is in the picture?"
FLEETS = [("llava", False), ("llava", True), ("qwen2_vl", False), ("qwen2_vl", True)]


@pytest.fixture(
    scope="module", params=FLEETS, ids=[f + ("-disagg" if d else "-agg") for f, d in FLEETS]
)
def served(request):
    family, disaggregated = request.param
    ckpt = checkpoint(family)
    spec = FleetSpec(
        port=0,
        model=ckpt,
        disaggregated=disaggregated,
        kvstore=disaggregated,  # (admission then validates while the kvstore is asked)
        extra_args={
            "worker": ["--num-kv-blocks", "256", "--block-size", str(BLOCK)],
            "router": ["--short-prompt-threshold", "1"],
        },
        startup_timeout_s=240,
    )
    with Fleet(spec) as fleet, GenerationClient(fleet.endpoint) as client:
        yield family, ckpt, client, disaggregated


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def ask(client, images, n=1):
    """Greedy completions of one user message with `images` then the question."""
    parts = [{"type": "image", "image": ImageSource(data=png(im))} for im in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    return client.generate(
        messages=messages, max_tokens=STEPS, temperature=0.0, ignore_eos=True, n=n
    )


def reference(family, ckpt, images):
    """The HF processor's inputs for the same chat (the checkpoint's own template) and
    transformers' greedy tokens."""
    from transformers import AutoTokenizer

    parts = [{"type": "image"} for _ in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    text = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    proc = processed(family, ckpt, text, images)
    return proc, hf_greedy(ckpt, proc, STEPS)


def test_greedy_tokens_equal_transformers(served):
    family, ckpt, client, disaggregated = served
    for n_images in (0, 1, 2):
        images = [image(20 + i, SIZES[family][i]) for i in range(n_images)]
        proc, want = reference(family, ckpt, images)
        res = ask(client, images)
        assert res.completions[0].token_ids == want, n_images
        assert res.usage.prompt_tokens == proc["input_ids"].shape[1]
        if disaggregated:  # n=2: prefilled by the decode worker, outside the lease
            res = ask(client, images, n=2)
            assert [c.token_ids for c in res.completions] == [want, want], n_images


def test_repeated_image_reports_cached_tokens(served):
    family, ckpt, client, _ = served
    img = image(40, SIZES[family][0])
    proc, want = reference(family, ckpt, [img])
    _, [im], _ = engine_inputs(family, proc)
    first = ask(client, [img])
    assert first.completions[0].token_ids == want
    again = ask(client, [img])
    assert again.completions[0].token_ids == want
    assert again.usage.cached_prompt_tokens >= im.end // BLOCK * BLOCK > im.offset
    # Same size, other pixels: the same placeholder tokens, no KV shared past the text.
    other = image(41, SIZES[family][0])
    proc2, want2 = reference(family, ckpt, [other])
    res = ask(client, [other])
    assert res.completions[0].token_ids == want2
    assert res.usage.cached_prompt_tokens == im.offset // BLOCK * BLOCK
    assert proc2["input_ids"].tolist() == proc["input_ids"].tolist()
