"""The KV block pool: per-request block tables over a fixed pool, with automatic prefix caching.

Only full blocks are hashed, each hash chained to its parent's; a hit is confirmed against
the block's token ids. A block whose owners have all finished keeps its hash and sits in the
free queue (least recently freed first), so a later request can take it back until the pool
needs it for something else.

The chain is SHA-256 (as vLLM's since its builtin-hash CVE-2025-25183): Python's ``hash`` of a
tuple of ints is not randomized and can be inverted round by round, so a client could craft a
prompt whose block hashes collide with another's prefix and take, or plant, K/V computed for a
different context; the token check alone confirms a block, not its parents. A request's
``cache_salt`` (vLLM's field) seeds its chain: its blocks are hits only for requests with the
same salt, so one tenant cannot time another's prompts through the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vivace.engine.request import Request


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class KVCacheStats:
    num_total_blocks: int
    num_free_blocks: int
    prefix_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_hits: int = 0     # of those, tokens found


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The digest of a block of ``token_ids`` after the blocks whose chain ends in ``parent``."""
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


def chain_root(request: Request) -> bytes | None:
    """The ``parent`` of a request's first block: its ``cache_salt``'s digest, None without one."""
    salt = request.params.cache_salt
    return None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


class KVCacheManager:
    """Owns the block pool. Three calls: ``get_computed_blocks``, ``allocate_slots``, ``free``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.tables: dict[str, list[Block]] = {}
        self.num_hashed: dict[str, int] = {}
        self.stats = KVCacheStats(num_blocks, num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / len(self.blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """The longest run of cached full blocks that prefixes the request's tokens, within
        ``request.num_cacheable_tokens`` (a request collecting prompt logprobs needs its logits).

        At least one token is always left to compute, so the step yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        num_full = min(request.num_tokens - 1, request.num_cacheable_tokens) // self.block_size
        hits: list[Block] = []
        for i in range(num_full):
            block = self.cached.get(self._block_hashes(request, i + 1)[i])
            if block is None or block.token_ids != self._block_tokens(request, i):
                break
            hits.append(block)
        return hits

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chain digests of the request's first ``num_blocks`` full blocks (at least), each
        computed once for its life (a request waiting for room is looked up at every step)."""
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else chain_root(request)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, self._block_tokens(request, i))
            hashes.append(parent)
        return hashes

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of the request (after taking
        ``computed_blocks`` from the prefix cache, for a request not yet holding any).
        Returns False, changing nothing, when the pool cannot hold them. A request's first
        allocation (its admission) counts as one prefix-cache query, hit or not."""
        computed_blocks = computed_blocks or []
        admitting = request.request_id not in self.tables
        table = self.tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(table) - len(computed_blocks)
        reclaimable = sum(1 for b in computed_blocks if b.ref_count == 0)
        if needed > len(self.free_queue) - reclaimable:
            return False
        table = self.tables.setdefault(request.request_id, table)
        for block in computed_blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            table.append(block)
        self.num_hashed.setdefault(request.request_id, len(computed_blocks))
        for _ in range(max(needed, 0)):
            table.append(self._take_free_block())
        if admitting and self.enable_prefix_caching:
            self.stats.prefix_queries += request.num_tokens
            self.stats.prefix_hits += len(computed_blocks) * self.block_size
        return True

    def _take_free_block(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Hash the request's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[request.request_id]
        start = self.num_hashed[request.request_id]
        end = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(table))
        hashes = self._block_hashes(request, end)
        for i in range(start, end):
            block = table[i]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                block.token_ids = self._block_tokens(request, i)
                self.cached.setdefault(hashes[i], block)
        self.num_hashed[request.request_id] = max(start, end)

    def forget(self, request: Request) -> list[int]:
        """Take the blocks that only ``request`` holds out of the prefix cache and return their
        ids: after a failed forward their contents may be garbage (NaN), so no later request may
        take them as a prefix, and the caller clears them before the pool hands them out again."""
        forgotten = []
        for block in self.tables.get(request.request_id, []):
            if block.ref_count == 1:
                if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
                forgotten.append(block.block_id)
        return forgotten

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's trailing blocks that hold no token below ``num_tokens``
        (slots reserved for rejected speculative tokens)."""
        table = self.tables.get(request.request_id, [])
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks go to the front of the eviction order."""
        table = self.tables.pop(request.request_id, [])
        self.num_hashed.pop(request.request_id, None)
        for block in reversed(table):
            self._release(block)

    def _release(self, block: Block) -> None:
        """Drop one owner; an unowned block joins the free queue, at the front (evicted first)
        unless it is hashed and may still serve a later prefix."""
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.block_id] = block
            if block.block_hash is None:
                self.free_queue.move_to_end(block.block_id, last=False)

    def check_integrity(self) -> None:
        """Prove free + owned == total, each block's ref count equals its owners, and no table
        holds a block twice. Raises AssertionError otherwise."""
        owners = [0] * len(self.blocks)
        for request_id, table in self.tables.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), f"request {request_id} holds a block twice"
            for block_id in ids:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but {owners[block.block_id]} owners")
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_count == 0), f"block {block.block_id} free-queue state is wrong"
            if not self.enable_prefix_caching:
                assert block.ref_count <= 1, f"block {block.block_id} has two owners"
        num_owned = sum(1 for n in owners if n)
        assert num_owned + len(self.free_queue) == len(self.blocks), "free + owned != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "prefix cache index points at a reused block"
