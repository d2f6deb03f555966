"""Choosing an engine replica for each request (Ray Serve ``RequestRouter`` subclasses).

``prefix`` (the default): the replica holding the longest cached prefix of the prompt's token
ids, at KV-block granularity, unless its queue is longer than the shortest one by more than
``imbalance_threshold`` requests, or the prefix covers less than ``min_share`` of the prompt;
otherwise (or when no replica holds any of it) the less loaded of two random replicas. The
share matters because prompts share short heads (a chat template's system prompt): the first
replica to see one would draw every new conversation until the imbalance threshold, and keep
them for all their turns (as SGLang's router, a match must cover a share of the prompt). The router cannot see the replicas' caches: it remembers which
prompt blocks it sent where (chained block hashes, as the engine's prefix cache keys them),
evicting the least recently used ones beyond each replica's KV pool, and forgets a replica
when it dies. ``pow2`` and ``round-robin`` are Ray Serve's own routers.

The outcomes go to ``vivace.cluster.client.ROUTING_DECISIONS``, reached through its module:
Serve ships this module to the ingress by value, with copies of the objects its functions
name, so a counter named here would not be the one ``/metrics`` reads.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vivace.cluster import client
from vivace.cluster.replica import GenerateCall

ROUTERS = {
    "prefix": "vivace.cluster.router:PrefixAwareRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
    "round-robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
}
_MAX_UNROUTED = 4096  # decisions kept for requests not routed yet (cancelled ones age out)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """One hash per full block, each covering every token before it too (and the request's
    ``cache_salt``: replicas share cached blocks only among requests of the same salt)."""
    hashes, previous = [], 0 if salt is None else hash(("cache_salt", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class BlockTable:
    """Which replica was sent which prompt blocks, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: dict[ReplicaID, collections.OrderedDict[int, None]] = {}
        self.holders: dict[int, set[ReplicaID]] = collections.defaultdict(set)

    def longest_match(self, hashes: list[int], candidates: set[ReplicaID]) -> tuple[set[ReplicaID], int]:
        """The candidates holding the longest run of ``hashes`` from the start, and its length."""
        best: set[ReplicaID] = set()
        for matched, block in enumerate(hashes):
            holders = self.holders.get(block, set()) & (best or candidates)
            if not holders:
                return best, matched
            best = holders
        return best, len(hashes)

    def add(self, replica: ReplicaID, hashes: list[int]) -> None:
        blocks = self.blocks.setdefault(replica, collections.OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
            self.holders[block].add(replica)
        while len(blocks) > self.capacity:
            block, _ = blocks.popitem(last=False)
            self._drop_holder(block, replica)

    def forget(self, replica: ReplicaID) -> None:
        for block in self.blocks.pop(replica, {}):
            self._drop_holder(block, replica)

    def _drop_holder(self, block: int, replica: ReplicaID) -> None:
        holders = self.holders[block]
        holders.discard(replica)
        if not holders:
            del self.holders[block]


class PrefixAwareRouter(RequestRouter):
    """See the module docstring. ``block_size`` and ``capacity_blocks`` are the engines'
    (KV block size, blocks per replica)."""

    def initialize_state(self, block_size: int = 16, capacity_blocks: int = 4096,
                         imbalance_threshold: int = 4, min_share: float = 0.3) -> None:
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.min_share = min_share
        self.table = BlockTable(capacity_blocks)
        self.decisions: dict[str, tuple[str, list[int], set[ReplicaID]]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """Ranks: the replicas holding the longest prefix (when not too busy), then two
        random ones; the base class takes the least loaded replica of the first rank that
        has room."""
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if pending_request is None:
            return [two]
        pending_request.routing_context.should_backoff = True  # when every replica is full
        call = pending_request.args[0] if pending_request.args else None
        if not isinstance(call, GenerateCall):
            return [two]
        hashes = block_hashes(call.prompt_ids, self.block_size, call.params.cache_salt)
        by_id = {r.replica_id: r for r in candidate_replicas}
        holders, matched = self.table.longest_match(hashes, set(by_id))
        outcome = "no_prefix"
        ranks = [two]
        if matched * self.block_size >= max(self.min_share * len(call.prompt_ids), 1):
            queues = await self._queue_lengths(candidate_replicas)
            shortest = min(queues.values(), default=0)
            fresh = [by_id[r] for r in holders if queues.get(r, 0) - shortest <= self.imbalance_threshold]
            outcome = "prefix_hit" if fresh else "fallback"
            ranks = [fresh, two] if fresh else [two]
        self.decisions[pending_request.metadata.internal_request_id] = (outcome, hashes, holders)
        if len(self.decisions) > _MAX_UNROUTED:
            self.decisions.pop(next(iter(self.decisions)))
        return ranks

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests ongoing at each replica: from the cache where fresh, else probed."""
        queues: dict[ReplicaID, int] = {}
        unknown = []
        for replica in replicas:
            cached = self._replica_queue_len_cache.get(replica.replica_id)
            if cached is None:
                unknown.append(replica)
            else:
                queues[replica.replica_id] = cached
        for replica, queue in await self._probe_queue_lens(unknown, 0) if unknown else []:
            if queue is not None:
                queues[replica.replica_id] = queue
        return queues

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: RequestMetadata | None = None) -> None:
        """Where Serve hands ``replica`` to the request it was chosen for (the documented
        ``on_request_routed`` hook only runs with Serve's strict max-ongoing-requests mode):
        counts the decision and records the prompt's blocks as sent there."""
        super()._fulfill_next_pending_request(replica, request_metadata)
        key = request_metadata.internal_request_id if request_metadata else None
        decision = self.decisions.pop(key, None)
        if decision is None:
            return
        outcome, hashes, holders = decision
        if outcome == "prefix_hit" and replica.replica_id not in holders:
            outcome = "fallback"
        client.ROUTING_DECISIONS[self._deployment_id.name, outcome] += 1  # by module: see above
        self.table.add(replica.replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.table.forget(replica_id)
