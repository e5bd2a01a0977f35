"""KV that crosses the engine's boundary: export, import, pinned prefills and reservations.

The worker builds the prefill/decode handoff and the kvstore on these hooks; the engine owns
one `KVHandoff` as `engine.kv`.

    read = engine.kv.start_export(owner, hashes)         # export by hash (kvstore put) ...
    payload = read.wait(); engine.kv.end_export(owner)   # ... off the engine's critical path
    engine.kv.import_cached_blocks(hashes, payload)       # import as prefix-cache content
    read = engine.kv.start_read(engine.kv.pinned_block_ids(rid))  # a done prefill's KV
    engine.kv.release_pinned(rid)                         # once read.wait() returned
    engine.kv.reserve(lease_id, num_prompt_tokens)        # decode side of a lease
    engine.kv.write_reserved(lease_id, first_block, payload)
    engine.start_decode(lease_id, rid, ...)               # the reservation becomes a request
    engine.kv.release_reserved(lease_id)                  # or it is given up

Payload layout: a CPU tensor (nb, num_layers, 2, block_size, num_kv_heads, head_dim), block
major, so `payload[i]` is one block (one wire frame); `block_shape` is its trailing part.

  - import: payload blocks become unreferenced prefix-cache content under their hashes, which a
    later request then hits (hashes already cached are skipped);
  - pins: a prefill-only request leaves the engine after its first token but keeps its blocks
    (the engine hands them over through `pin`) until `release_pinned`, or the engine's `abort`;
  - reservations: fresh blocks held under an owner id (the lease id) until `release_reserved`,
    or until `hand_over` gives them to the request `start_decode` admits;
  - exports: cached blocks held under an owner id while a read copies them out (on CUDA on a
    side stream into pinned memory, beside later steps), until `end_export`.

Who mutates what: only this class adds or removes pins, reservations and exports; the block
manager owns the blocks' reference counts and hashes. Every method is synchronous and runs
between engine steps (in a worker, on its engine thread), never while a step runs; a read it
started may finish later, off the engine thread.

Block accounting invariant: every path that ends a request, pin, reservation or export
returns its blocks, so once all of them have ended `num_free_blocks` is back at its idle value.
"""

from __future__ import annotations

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.model_runner import BlockRead, ModelRunner
from llmfleet.engine.request import Request
from llmfleet.shared.core.errors import CapacityError, ValidationError


def stage_payload(blocks: list[torch.Tensor], *, pinned: bool) -> torch.Tensor:
    """Blocks received from a peer (host views, each (L, 2, bs, H, D)) as one payload
    (nb, L, 2, bs, H, D) for `write_reserved`, in pinned memory when `pinned` (a CUDA engine:
    the copy to the GPU is then asynchronous). A host copy: call it off the engine thread."""
    if not blocks:
        raise ValueError("no blocks to stage")
    shape = (len(blocks), *blocks[0].shape)
    out = torch.empty(shape, dtype=blocks[0].dtype, pin_memory=pinned)
    return torch.stack(blocks, out=out)


class KVHandoff:
    def __init__(self, block_manager: BlockManager, runner: ModelRunner, max_model_len: int):
        self.block_manager = block_manager
        self.runner = runner
        self.max_model_len = max_model_len
        self._pinned: dict[str, Request] = {}  # prefill-only requests done, blocks held
        self._reserved: dict[str, int] = {}  # reservation owner (lease id) -> blocks held
        self._exports: set[str] = set()  # owners of blocks held while they are read out

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim): one block's payload."""
        return self.runner.block_shape

    @property
    def dtype(self) -> torch.dtype:
        """The KV cache's dtype, which payloads are read in and converted to on write."""
        return self.runner.kv_caches[0].dtype

    # ---- export and import -----------------------------------------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """KV of these blocks as a CPU payload (nb, num_layers, 2, block_size, Hkv, head_dim)."""
        return self.runner.read_blocks(block_ids)

    def start_read(self, block_ids: list[int], *, to_host: bool = True) -> BlockRead:
        """`read_blocks` without waiting: the copy runs beside later steps (on CUDA); the
        caller keeps the blocks from being rewritten until it is done (pinned, or exported).
        `to_host` False on CUDA: the payload is a device tensor (`ModelRunner.start_read`)."""
        return self.runner.start_read(block_ids, to_host=to_host)

    def start_export(self, owner: str, block_hashes: list[bytes]) -> BlockRead | None:
        """Hold the cached blocks with these hashes under `owner` and start reading them; None
        (holding nothing) if any of them left the cache. `end_export(owner)` lets them go."""
        ids = self.block_manager.hold_cached(owner, block_hashes)
        if ids is None:
            return None
        self._exports.add(owner)
        return self.runner.start_read(ids)

    def end_export(self, owner: str) -> None:
        if owner in self._exports:
            self._exports.discard(owner)
            self.block_manager.free_owner(owner)

    def num_cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        return self.block_manager.num_cached_prefix(block_hashes)

    def import_cached_blocks(self, block_hashes: list[bytes], payload: torch.Tensor) -> int:
        """Register payload blocks as prefix-cache content (unreferenced); how many were new.

        `payload[i]` is the KV of `block_hashes[i]`. Hashes already cached are skipped; when
        free blocks run short, the rest is not imported.
        """
        if payload.shape[0] != len(block_hashes):
            raise ValueError(f"{payload.shape[0]} payload blocks for {len(block_hashes)} hashes")
        if tuple(payload.shape[1:]) != self.block_shape:
            raise ValueError(f"payload block shape {tuple(payload.shape[1:])} is not ours")
        placed = self.block_manager.import_blocks(block_hashes)
        if placed:
            rows = torch.tensor([i for i, _ in placed], dtype=torch.long)
            self.runner.write_blocks([b for _, b in placed], payload.index_select(0, rows))
        return len(placed)

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) prefix-cache hashes since the last call (enables recording)."""
        self.block_manager.record_events = True
        return self.block_manager.drain_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.block_manager.cached_hashes()

    # ---- pinned prefills -------------------------------------------------------------------
    def pin(self, req: Request) -> None:
        """Hold the blocks of a prefill-only request the engine has finished (not freed)."""
        self._pinned[req.request_id] = req

    def pinned_request_ids(self) -> list[str]:
        return list(self._pinned)

    def pinned_block_ids(self, request_id: str) -> list[int]:
        """The blocks of a done prefill-only request, in block-table order."""
        if request_id not in self._pinned:
            raise KeyError(request_id)
        return list(self.block_manager.block_ids(request_id))

    def release_pinned(self, request_id: str) -> bool:
        req = self._pinned.pop(request_id, None)
        if req is None:
            return False
        self.block_manager.free(req)
        return True

    # ---- reservations ----------------------------------------------------------------------
    def reserve(self, owner: str, num_tokens: int) -> int:
        """Hold blocks for `num_tokens` tokens of KV that will be written in; returns how many.

        Raises CapacityError when the free blocks (including evictable cached ones) are short
        now, ValidationError when the whole cache could never hold them.
        """
        if num_tokens < 1:
            raise ValidationError("num_prompt_tokens", f"must be >= 1, got {num_tokens}")
        if num_tokens >= self.max_model_len:
            raise ValidationError(
                "num_prompt_tokens",
                f"{num_tokens} tokens leave no room to generate within the context length "
                f"{self.max_model_len}",
            )
        num_blocks = self.block_manager.blocks_needed(num_tokens)
        if num_blocks > self.block_manager.num_blocks:  # never fits: not worth waiting for
            raise ValidationError(
                "num_prompt_tokens",
                f"{num_tokens} tokens need {num_blocks} KV blocks, the cache has "
                f"{self.block_manager.num_blocks}",
            )
        if self.block_manager.allocate_owned(owner, num_blocks) is None:
            raise CapacityError(
                f"{num_blocks} KV blocks needed, {self.block_manager.num_free_blocks} free"
            )
        self._reserved[owner] = num_blocks
        return num_blocks

    def reserved_blocks(self, owner: str) -> int:
        """How many blocks reservation `owner` holds; KeyError when it holds none."""
        return self._reserved[owner]

    def write_reserved(self, owner: str, first_block: int, payload: torch.Tensor) -> None:
        """Copy payload blocks into a reservation's blocks [first_block, first_block + nb)."""
        num_blocks = self.reserved_blocks(owner)
        nb = payload.shape[0]
        if first_block < 0 or first_block + nb > num_blocks:
            raise ValueError(
                f"blocks [{first_block}, {first_block + nb}) outside the {num_blocks} reserved"
            )
        ids = self.block_manager.block_ids(owner)[first_block : first_block + nb]
        self.runner.write_blocks(ids, payload)

    def hand_over(self, owner: str, request_id: str) -> None:
        """End reservation `owner` by giving its blocks to request `request_id`."""
        del self._reserved[owner]
        self.block_manager.transfer_owner(owner, request_id)

    def release_reserved(self, owner: str) -> bool:
        if self._reserved.pop(owner, None) is None:
            return False
        self.block_manager.free_owner(owner)
        return True

    @property
    def num_reserved_blocks(self) -> int:
        return sum(self._reserved.values())
