"""Paged KV-cache bookkeeping: blocks, reference counts, prefix cache, O(1) LRU free queue.

The KV cache is `num_blocks` blocks of `block_size` token slots. A request holds a list of
blocks (its block table); block i holds tokens [i*block_size, (i+1)*block_size).

    request A: [b7][b2][b9]      tokens 0..47 (b9 partly filled)
    request B: [b7][b2][b4]      same first 32 tokens -> shares b7, b2 (ref_cnt 2)

Full blocks whose KV is computed are registered in the prefix cache under their chained block
hash. A block whose ref_cnt drops to 0 goes to the free queue but keeps its hash, so a later
request with the same prefix can take it back ("touch") until it is evicted. The free queue is
LRU: blocks are allocated (and their cached content evicted) from the front, freed blocks are
appended at the back; blocks with no cached content are put at the front since they are worth
nothing. Only unreferenced blocks are ever evicted.

The block manager owns every block's `ref_cnt` and `block_hash`; callers only pass requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmfleet.services.worker.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) pop, push and remove-from-middle."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        b.prev, b.next = last, self._tail
        last.next = self._tail.prev = b
        self.num_free += 1

    def appendleft(self, b: KVBlock) -> None:
        first = self._head.next
        assert first is not None
        b.prev, b.next = self._head, first
        first.prev = self._head.next = b
        self.num_free += 1

    def remove(self, b: KVBlock) -> None:
        prev, nxt = b.prev, b.next
        if prev is None or nxt is None:
            raise ValueError(f"{b} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        b.prev = b.next = None
        self.num_free -= 1

    def __len__(self) -> int:
        return self.num_free

    def ids(self) -> list[int]:
        out, b = [], self._head.next
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next
        return out


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of which found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}  # per request: leading blocks in the cache
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free, including cached-but-unreferenced ones)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest cached prefix of `req` (whole blocks), leaving >= 1 token to compute.

        At least one token must run through the model so that the step yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[KVBlock] = []
        for h in req.block_hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()
        self.stats.num_queries += req.num_tokens
        self.stats.num_hits += len(hits) * self.block_size
        return hits

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_tokens: int, computed: Sequence[KVBlock] = ()
    ) -> bool:
        """Grow `req`'s block table so it holds `num_tokens` tokens; False if memory is short.

        `computed` (only for a request holding no blocks yet) are prefix-cache hits from
        `get_computed_blocks`; they are taken first and shared. Nothing changes on failure.
        """
        held = self.req_blocks.get(req.request_id)
        if computed and held:
            raise ValueError("computed blocks can only start an empty block table")
        num_held = len(held) if held else 0
        num_new = self.blocks_needed(num_tokens) - num_held - len(computed)
        # Touching a cached block with ref_cnt 0 takes it off the free queue too.
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new + num_revived > self.num_free_blocks:
            return False
        if held is None:
            held = self.req_blocks[req.request_id] = []
            # Prefix hits are registered already: registration resumes after them.
            self._num_registered[req.request_id] = len(computed)
        for b in computed:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            held.append(b)
        for _ in range(max(num_new, 0)):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict its cached content
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            held.append(b)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register `req`'s blocks that are full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        held = self.req_blocks.get(req.request_id)
        if not held:
            return
        start = self._num_registered[req.request_id]
        end = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(held))
        for i in range(start, end):
            b, h = held[i], req.block_hashes[i]
            if b.block_hash is None and h not in self.cached:
                b.block_hash = h
                self.cached[h] = b
            # else: another block already holds this content; this one stays private.
        self._num_registered[req.request_id] = max(start, end)

    def free(self, req: Request) -> None:
        """Release every block `req` holds (finish, abort or preemption). Idempotent."""
        held = self.req_blocks.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        if not held:
            return
        # Tail blocks first: when a prefix is evicted, its deepest blocks should go first.
        for b in reversed(held):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of unreferenced blocks."""
        for h, b in list(self.cached.items()):
            if b.ref_cnt == 0:
                del self.cached[h]
                b.block_hash = None
