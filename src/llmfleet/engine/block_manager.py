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

The block manager owns every block's `ref_cnt` and `block_hash`; callers pass requests (or,
for blocks held outside a request, an owner id: a lease's reservation, a pinned prefill).

KV events: with `record_events` on, every hash that enters the prefix cache (registration,
import) and every hash that leaves it (eviction, reset) is recorded; `drain_events()` returns the
net change since the last drain, so a subscriber that applies it to the previous set gets
exactly `cached_hashes()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmfleet.engine.request import Request


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
    """Doubly linked list of free blocks with sentinels: O(1) pop, push and remove-from-middle.

    Blocks never used yet (`fresh`, a range of ids) are not objects until the queue reaches
    them: one marker node stands for the run, a new `KVBlock` per pop, so a cache of any size
    starts in O(1) (a small model on a big GPU has tens of millions of blocks). `made` lists
    the blocks created so far, by id."""

    def __init__(self, blocks: Sequence[KVBlock] = (), fresh: range = range(0)) -> None:
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        self.made: list[KVBlock] = []
        self._fresh = fresh
        self._marker = KVBlock(-2)
        if fresh:
            self.append(self._marker)
            self.num_free += len(fresh) - 1
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        if b is not self._marker:
            self.remove(b)
            return b
        b, self._fresh = KVBlock(self._fresh[0]), self._fresh[1:]  # never used: made now
        self.made.append(b)
        if self._fresh:
            self.num_free -= 1
        else:
            self.remove(self._marker)
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
            out.extend(self._fresh if b is self._marker else [b.block_id])
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
        self.free_queue = FreeBlockQueue(fresh=range(num_blocks))
        self.blocks = self.free_queue.made  # by id: those taken at least once
        self.cached: dict[bytes, KVBlock] = {}
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept beside them (a list only grows; `trim` replaces
        # it with a shorter one).
        self._req_ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # per request: leading blocks in the cache
        self.stats = PrefixCacheStats()
        self.record_events = False
        # Net cache changes since the last drain: hash -> True (now cached) / False (evicted).
        self._events: dict[bytes, bool] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free, including cached-but-unreferenced ones)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids: the live list, which grows with the table (read
        it, do not change it; copy it to keep it; `trim` replaces it). Empty for an owner
        holding nothing."""
        return self._req_ids.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now (referenced or not)."""
        return list(self.cached)

    def num_cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a hash chain are in the prefix cache."""
        n = 0
        for h in block_hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes since the last drain (see the module docstring)."""
        events, self._events = self._events, {}
        stored = [h for h, cached in events.items() if cached]
        removed = [h for h, cached in events.items() if not cached]
        return stored, removed

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
            self._req_ids[req.request_id] = []
            # Prefix hits are registered already: registration resumes after them.
            self._num_registered[req.request_id] = len(computed)
        ids = self._req_ids[req.request_id]
        for b in computed:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            held.append(b)
            ids.append(b.block_id)
        for _ in range(max(num_new, 0)):
            b = self._take_free_block()
            held.append(b)
            ids.append(b.block_id)
        return True

    def _take_free_block(self) -> KVBlock:
        """Pop the LRU free block, evicting its cached content; it comes back with ref_cnt 1."""
        b = self.free_queue.popleft()
        if b.block_hash is not None:
            self._uncache(b)
        b.ref_cnt = 1
        return b

    def _uncache(self, b: KVBlock) -> None:
        h = b.block_hash
        if h is not None and self.cached.get(h) is b:
            del self.cached[h]
            if self.record_events:
                self._events[h] = False
        b.block_hash = None

    def _register(self, b: KVBlock, h: bytes) -> None:
        b.block_hash = h
        self.cached[h] = b
        if self.record_events:
            self._events[h] = True

    def allocate_owned(self, owner: str, num_blocks: int) -> list[int] | None:
        """Hold `num_blocks` fresh blocks for `owner` (no prefix hits); None if memory is short.

        Used for lease reservations: the owner is not a scheduled request, and its blocks are
        never preempted. `transfer_owner` later hands them to the request that decodes.
        """
        if owner in self.req_blocks:
            raise ValueError(f"{owner!r} already holds blocks")
        if num_blocks > self.num_free_blocks:
            return None
        held = self.req_blocks[owner] = [self._take_free_block() for _ in range(num_blocks)]
        self._req_ids[owner] = [b.block_id for b in held]
        self._num_registered[owner] = 0
        return list(self._req_ids[owner])

    def hold_cached(self, owner: str, block_hashes: Sequence[bytes]) -> list[int] | None:
        """Hold the cached blocks with these hashes under `owner` (they cannot be evicted or
        rewritten until `free_owner`); None, holding nothing, if any of them is not cached."""
        if owner in self.req_blocks:
            raise ValueError(f"{owner!r} already holds blocks")
        blocks = [self.cached.get(h) for h in block_hashes]
        if any(b is None for b in blocks):
            return None
        held: list[KVBlock] = []
        for b in blocks:
            assert b is not None
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            held.append(b)
        self.req_blocks[owner] = held
        self._req_ids[owner] = [b.block_id for b in held]
        self._num_registered[owner] = len(held)
        return list(self._req_ids[owner])

    def transfer_owner(self, old: str, new: str) -> None:
        """Rename the holder of a block table (a reservation becoming a running request)."""
        if new in self.req_blocks:
            raise ValueError(f"{new!r} already holds blocks")
        self.req_blocks[new] = self.req_blocks.pop(old)
        self._req_ids[new] = self._req_ids.pop(old)
        self._num_registered[new] = self._num_registered.pop(old)

    def import_blocks(self, block_hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """Take free blocks for hashes not cached yet and register them, unreferenced.

        Returns (index into `block_hashes`, block id) for each block the caller must now fill
        with KV content (before anything can read it: the engine does both between steps).
        Imported blocks go to the MRU end of the free queue, like any freed cached block. The
        chain's blocks cached already (a local prefix the import extends) are first moved there
        too, its head last, and are not counted as room: an import never evicts its own chain.
        """
        if not self.enable_prefix_caching:
            return []
        kept = [b for h in reversed(block_hashes) if (b := self.cached.get(h)) is not None]
        for b in kept:  # (the tail first, so the chain's head ends most recently used)
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.free_queue.append(b)
        out: list[tuple[int, int]] = []
        budget = self.num_free_blocks - sum(1 for b in kept if b.ref_cnt == 0)
        for i, h in enumerate(block_hashes):
            if h in self.cached:
                continue
            if len(out) >= budget:
                break
            b = self._take_free_block()
            b.ref_cnt = 0
            self._register(b, h)
            self.free_queue.append(b)
            out.append((i, b.block_id))
        return out

    def cached_block_ids(self, block_hashes: Sequence[bytes]) -> list[int] | None:
        """Block ids holding these hashes, or None if any of them is not cached."""
        out = []
        for h in block_hashes:
            b = self.cached.get(h)
            if b is None:
                return None
            out.append(b.block_id)
        return out

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
                self._register(b, h)
            # else: another block already holds this content; this one stays private.
        self._num_registered[req.request_id] = max(start, end)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release `req`'s tail blocks past those that hold `num_tokens` tokens (slots of
        rejected draft tokens): never-registered blocks, back to the front of the free queue."""
        held = self.req_blocks.get(req.request_id)
        keep = max(self.blocks_needed(num_tokens), self._num_registered.get(req.request_id, 0))
        if not held or len(held) <= keep:
            return
        # A new id list: a reader that caches a table by identity (cuda_graphs.DecodeBuffers,
        # which takes a list it saw before to have only grown) sees a new table.
        self._req_ids[req.request_id] = self._req_ids[req.request_id][:keep]
        while len(held) > keep:
            self._unref(held.pop())

    def free(self, req: Request) -> None:
        """Release every block `req` holds (finish, abort or preemption). Idempotent."""
        self.free_owner(req.request_id)

    def free_owner(self, owner: str) -> bool:
        """Release every block held under `owner`; False if it held none. Idempotent."""
        held = self.req_blocks.pop(owner, None)
        self._req_ids.pop(owner, None)
        self._num_registered.pop(owner, None)
        if not held:
            return False
        # Tail blocks first: when a prefix is evicted, its deepest blocks should go first.
        for b in reversed(held):
            self._unref(b)
        return True

    def _unref(self, b: KVBlock) -> None:
        """Drop one reference to `b`; unreferenced, it joins the free queue: at the front when
        it caches nothing (reused first), at the back when it holds a prefix (evicted last)."""
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            if b.block_hash is None:
                self.free_queue.appendleft(b)
            else:
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget all cached content of unreferenced blocks."""
        for b in list(self.cached.values()):
            if b.ref_cnt == 0:
                self._uncache(b)
