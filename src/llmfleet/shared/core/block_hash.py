"""The one block-hash function of llmfleet (tokenizer, router, worker and kvstore share it).

A block's hash identifies its KV content: the chain of every token before it and the context
that changes what those tokens' KV are. Specification (version 1), for full blocks only:

    h_0 = 32 zero bytes                                   (the root parent)
    h_i = SHA-256( b"llmfleet-block-v1\\x00"
                   || h_{i-1}                               32 bytes
                   || u32le(len(tokens_i)) || u32le(t) for t in tokens_i
                   || u32le(len(extra_i))  || for each extra key e: u32le(len(e)) || e )

`extra_i` is a list of byte strings, in this order:
  - in block 0 only: b"model:" + model_id, b"salt:" + cache_salt, b"adapter:" + adapter_id
    (each only when non-empty; block 0 anchors the whole chain, so later blocks inherit them);
  - in every block: b"mm:" + content_hash for each multimodal item whose placeholder tokens
    overlap the block, in order of their offsets.

Test vectors live in `block_hash_vectors.json` beside this file; any implementation in any
language must reproduce them.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = bytes(32)
_DOMAIN = b"llmfleet-block-v1\x00"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class HashContext:
    """What, besides the tokens, decides a chain's KV content."""

    model_id: str = ""
    cache_salt: str = ""
    adapter_id: str = ""

    def first_block_keys(self) -> list[bytes]:
        keys = []
        if self.model_id:
            keys.append(b"model:" + self.model_id.encode())
        if self.cache_salt:
            keys.append(b"salt:" + self.cache_salt.encode())
        if self.adapter_id:
            keys.append(b"adapter:" + self.adapter_id.encode())
        return keys


@dataclass(frozen=True)
class MultimodalSpan:
    """A multimodal item's placeholder tokens: `length` tokens from `offset`."""

    offset: int
    length: int
    content_hash: str


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[bytes] = ()) -> bytes:
    """Hash one block given its parent's hash (ROOT_HASH for the first block)."""
    if len(parent) != 32:
        raise ValueError(f"parent hash must be 32 bytes, got {len(parent)}")
    tokens = array("I", token_ids)
    if tokens.itemsize != 4:  # pragma: no cover - array('I') is 4 bytes on every platform we run
        tokens = array("L", token_ids)
    if array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - big-endian hosts
        tokens.byteswap()
    m = hashlib.sha256(_DOMAIN)
    m.update(parent)
    m.update(_U32.pack(len(tokens)))
    m.update(tokens.tobytes())
    m.update(_U32.pack(len(extra_keys)))
    for key in extra_keys:
        m.update(_U32.pack(len(key)))
        m.update(key)
    return m.digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    context: HashContext = HashContext(),
    mm_spans: Sequence[MultimodalSpan] = (),
    *,
    start_block: int = 0,
    parent: bytes = ROOT_HASH,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, from block `start_block` on.

    To extend a chain incrementally pass the last known hash as `parent` and the index of the
    first block still to hash as `start_block`.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    out: list[bytes] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        lo, hi = i * block_size, (i + 1) * block_size
        extra = context.first_block_keys() if i == 0 else []
        for span in mm_spans:
            if span.offset < hi and span.offset + span.length > lo:
                extra.append(b"mm:" + span.content_hash.encode())
        parent = hash_block(parent, token_ids[lo:hi], extra)
        out.append(parent)
    return out
