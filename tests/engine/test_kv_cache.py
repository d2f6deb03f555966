import pytest

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.request import Request
from vivace.engine.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 10)
    assert len(kv.block_ids("a")) == 3
    kv.check_integrity()
    kv.free(request)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []
    kv.check_integrity()


def test_prefix_hit_is_confirmed_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    kv.free(first)
    # Same 12 tokens: only 2 full blocks may be reused, the last token must be computed.
    again = make_request("b", list(range(12)))
    assert len(kv.get_computed_blocks(again)) == 2
    # Diverging in the second block: only the first block matches.
    other = make_request("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    hits = kv.get_computed_blocks(other)
    assert [b.block_id for b in hits] == kv_first_block(kv, first_tokens=(0, 1, 2, 3))
    assert kv.allocate_slots(other, 5, hits)
    kv.check_integrity()
    kv.free(other)
    kv.check_integrity()


def test_a_request_scoring_its_prompt_takes_hits_only_before_its_first_unscored_position():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    computed_and_freed(kv, make_request("a", list(range(13))))
    scoring = Request("b", list(range(13)), SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(scoring) == []  # token 1's logprob needs position 0's logits
    scoring.prompt_logprobs += [None] * 9  # tokens 0 to 9 scored (as before a preemption)
    assert len(kv.get_computed_blocks(scoring)) == 2  # positions 0-7 cached; 9 on need computing
    scoring.prompt_logprobs += [None] * 3  # every prompt token scored
    assert len(kv.get_computed_blocks(scoring)) == 3


def computed_and_freed(kv: KVCacheManager, request: Request) -> None:
    """``request`` computed whole, its full blocks cached, then finished."""
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.free(request)


def kv_first_block(kv: KVCacheManager, first_tokens: tuple[int, ...]) -> list[int]:
    return [b.block_id for b in kv.blocks if b.token_ids == first_tokens]


def test_shared_blocks_are_counted_per_owner_and_evicted_last():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 7])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert kv.allocate_slots(b, 1, hits)
    assert all(block.ref_count == 2 for block in hits)
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # Filling the pool evicts unhashed blocks first, then cached ones, least recent first.
    c = make_request("c", list(range(100, 108)))
    assert kv.allocate_slots(c, 8)
    kv.check_integrity()
    assert len(kv.get_computed_blocks(make_request("d", [1, 2, 3, 4, 5]))) == 2


def test_integrity_check_detects_a_double_owner():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    assert kv.allocate_slots(a, 2) and kv.allocate_slots(b, 2)
    kv.tables["b"].append(kv.tables["a"][0])
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_a_salted_prefix_is_a_hit_only_for_the_same_salt():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    computed_and_freed(kv, Request("a", list(range(13)), SamplingParams(cache_salt="tenant-1")))
    salted = {salt: Request(f"b-{salt}", list(range(13)), SamplingParams(cache_salt=salt))
              for salt in ("tenant-1", "tenant-2")}
    assert len(kv.get_computed_blocks(salted["tenant-1"])) == 3
    assert kv.get_computed_blocks(salted["tenant-2"]) == []
    assert kv.get_computed_blocks(make_request("c", list(range(13)))) == []  # no salt: none of them
    computed_and_freed(kv, make_request("d", list(range(13))))
    assert len(kv.get_computed_blocks(make_request("e", list(range(13))))) == 3
    assert kv.get_computed_blocks(salted["tenant-2"]) == []
    kv.check_integrity()


def test_block_hashes_chain_every_parent_block():
    """A block is a hit only after the very blocks it was computed after: the same tokens after a
    different first block hash differently (with SHA-256, no prompt can be crafted to collide)."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    computed_and_freed(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))) == 2
    assert kv.get_computed_blocks(make_request("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    hashes = [b.block_hash for b in kv.blocks if b.block_hash is not None]
    assert len(hashes) == 2 and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
