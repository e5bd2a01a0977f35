"""What one forward step tells the attention layers: a flattened variable-length batch.

A step runs `num_tokens` new tokens belonging to `num_seqs` sequences, laid end to end with no
padding. Sequence `i` contributes `query_lens[i]` new tokens at positions
`seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`; everything before them is already in the
paged KV cache.

KV cache layout, one tensor per layer (shared by the CPU reference and the Triton kernels):

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)
               ^ 0 = keys, 1 = values

    token t of sequence i lives in block  block_tables[i, t // block_size]
                                 at offset t % block_size
    slot = block_id * block_size + offset   (so kv_cache[0].view(-1, H, D)[slot] is its key)

`slot_mapping[j]` is the slot where new token j's key and value are written this step; a
negative slot marks a padding token whose key and value are not written.
Block ids in `block_tables` rows past a sequence's last block are padding and must not be read.

Inside a CUDA graph (engine/cuda_graphs.py) the host-side fields are bounds, not values:
`max_seq_len` and `seq_lens_cpu` hold the static context limit, and the true lengths are only
in the device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 (num_seqs + 1,), cumulative query lengths, [0] == 0
    seq_lens: torch.Tensor  # int32 (num_seqs,), context length including this step's tokens
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks_per_seq), padded with 0
    slot_mapping: torch.Tensor  # int64 (num_tokens,)
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code never syncs on device tensors.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence has exactly one new token (the common decode step)."""
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from per-sequence lists (slots follow from the block tables)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per seq")
        slots: list[int] = []
        starts = [0]
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q < 1 or q > s:
                raise ValueError(f"bad query_len {q} for seq_len {s}")
            if len(table) * block_size < s:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s} tokens")
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + q)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            num_seqs=len(query_lens),
            num_tokens=starts[-1],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
                len(block_tables), width
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
