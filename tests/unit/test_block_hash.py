"""Block hashes: the shipped test vectors, recomputed from the written specification."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

import llmfleet.shared.core.block_hash as bh

VECTORS = json.loads((Path(bh.__file__).parent / "block_hash_vectors.json").read_text())


def _spec_chain(tokens, block_size, context, mm):
    """Straight from the module docstring, written independently of the implementation."""
    parent, out = bytes(32), []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size : (i + 1) * block_size]
        extra = []
        if i == 0:
            for key, prefix in (
                ("model_id", b"model:"),
                ("cache_salt", b"salt:"),
                ("adapter_id", b"adapter:"),
            ):
                if context.get(key):
                    extra.append(prefix + context[key].encode())
        for m in mm:
            lo, hi = i * block_size, (i + 1) * block_size
            if m["offset"] < hi and m["offset"] + m["length"] > lo:
                extra.append(b"mm:" + m["content_hash"].encode())
        data = b"llmfleet-block-v1\x00" + parent + struct.pack("<I", len(blk))
        data += b"".join(struct.pack("<I", t) for t in blk)
        data += struct.pack("<I", len(extra))
        data += b"".join(struct.pack("<I", len(e)) + e for e in extra)
        parent = hashlib.sha256(data).digest()
        out.append(parent.hex())
    return out


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_vectors_match_implementation_and_spec(case):
    ctx = bh.HashContext(**case["context"])
    mm = [bh.MultimodalSpan(**m) for m in case["mm"]]
    got = [h.hex() for h in bh.hash_block_chain(case["tokens"], case["block_size"], ctx, mm)]
    assert got == case["hashes"]
    assert _spec_chain(case["tokens"], case["block_size"], case["context"], case["mm"]) == got


def test_chain_depends_on_prefix_salt_and_model():
    toks = list(range(64))
    base = bh.hash_block_chain(toks, 16)
    assert len(base) == 4 and len(set(base)) == 4
    changed = bh.hash_block_chain([999] + toks[1:], 16)
    assert all(a != b for a, b in zip(base, changed, strict=True))  # every later block differs
    salted = bh.hash_block_chain(toks, 16, bh.HashContext(cache_salt="s"))
    other_model = bh.hash_block_chain(toks, 16, bh.HashContext(model_id="m"))
    assert not set(base) & set(salted) and not set(base) & set(other_model)


def test_incremental_extension_equals_full_chain():
    toks = [(i * 31) % 1000 for i in range(100)]
    full = bh.hash_block_chain(toks, 8)
    head = bh.hash_block_chain(toks[:40], 8)
    tail = bh.hash_block_chain(toks, 8, start_block=len(head), parent=head[-1])
    assert head + tail == full


def test_an_image_changes_the_blocks_from_its_placeholders_on():
    from llmfleet.shared.core.multimodal import ImageRef, mm_spans

    toks = [7] * 10 + [259] * 12 + [8] * 10  # placeholders [10, 22) over blocks 1 and 2
    one, two = "a" * 64, "b" * 64
    first = bh.hash_block_chain(toks, 8, mm_spans=mm_spans([ImageRef(one, 10, 12)]))
    again = bh.hash_block_chain(toks, 8, mm_spans=mm_spans([ImageRef(one, 10, 12)]))
    other = bh.hash_block_chain(toks, 8, mm_spans=mm_spans([ImageRef(two, 10, 12)]))
    assert first == again and len(first) == 4
    assert first[0] == other[0]  # the text before the image
    assert all(a != b for a, b in zip(first[1:], other[1:], strict=True))
