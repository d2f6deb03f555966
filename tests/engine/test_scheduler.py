"""Scheduling on a tiny random Llama: greedy outputs whatever the prefix cache and chunk size,
the KV pool whole under random arrivals, aborts and preemptions, priorities respected."""

from __future__ import annotations

import random

import pytest

from vivace import SamplingParams
from vivace.config import EngineConfig
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.request import Request, RequestStatus
from vivace.engine.scheduler import Scheduler

VOCAB = 49152


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def shared_prefix_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 1 to 40 tokens, most starting with some of one 24-token prefix."""
    rng = random.Random(seed)
    prefix = random_ids(rng, 24)
    return [prefix[:rng.randrange(0, 25)] + random_ids(rng, rng.randrange(1, 17)) for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy token ids of every prompt, all queued at once."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"g{i}", prompt, greedy(n))
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return list(tokens.values())


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> LLMEngine:
    """No prefix cache, a budget that takes every prompt whole."""
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4,
                                  enable_prefix_caching=False))


def engine_like(reference: LLMEngine, **config: object) -> LLMEngine:
    """Another engine on the reference's loaded weights."""
    return LLMEngine(EngineConfig(model=reference.config.model, block_size=4, **config), reference.loaded)


def test_greedy_is_identical_with_and_without_prefix_cache_and_any_chunk(reference: LLMEngine) -> None:
    prompts = shared_prefix_prompts(seed=7, count=8)
    lengths = [3 + i for i in range(8)]
    expected = generate(reference, prompts, lengths)
    for caching, budget, chunk in [(True, 512, 64), (True, 512, 3), (True, 13, 5), (False, 7, 2)]:
        engine = engine_like(reference, num_kv_blocks=128, max_num_batched_tokens=budget,
                             max_prefill_chunk=chunk, enable_prefix_caching=caching)
        assert generate(engine, prompts, lengths) == expected, (caching, budget, chunk)
        assert generate(engine, prompts, lengths) == expected, (caching, budget, chunk)  # cache hits
        stats = engine.stats()
        assert (stats.prefix_hits > 0) == caching
        engine.check_integrity()
        assert stats.num_free_blocks == stats.num_total_blocks


def run_random_schedule(engine: LLMEngine, jobs: list[tuple[list[int], int]], seed: int
                        ) -> tuple[dict[str, list[int]], set[str]]:
    """Arrivals, aborts and priorities drawn from ``seed``; integrity checked after every step.
    Returns each request's tokens and the ids of those aborted."""
    rng = random.Random(seed)
    pending = list(enumerate(jobs))
    live: list[str] = []
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for _ in range(5000):
        if not pending and not engine.has_unfinished():
            return tokens, aborted
        if pending and rng.random() < 0.4:
            i, (prompt, max_tokens) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy(max_tokens), priority=rng.choice([0, 5, 10]))
            live.append(f"r{i}")
            tokens[f"r{i}"] = []
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            if out.finished:
                live.remove(out.request_id)
        engine.check_integrity()
    raise AssertionError("the schedule did not drain")


def test_random_arrivals_aborts_and_preemptions_keep_the_pool_whole(reference: LLMEngine) -> None:
    prompts = shared_prefix_prompts(seed=11, count=40)
    rng = random.Random(12)
    lengths = [rng.randrange(1, 17) for _ in prompts]
    expected = generate(reference, prompts, lengths)
    engine = engine_like(reference, num_kv_blocks=24, max_num_batched_tokens=24, max_num_seqs=8)
    tokens, aborted = run_random_schedule(engine, list(zip(prompts, lengths)), seed=13)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0 and aborted
    assert stats.num_free_blocks == stats.num_total_blocks
    for i, want in enumerate(expected):
        if f"r{i}" not in aborted:
            assert tokens[f"r{i}"] == want, f"request {i} changed under scheduling"


def make_request(request_id: str, num_tokens: int, priority: int, order: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), greedy(8), priority, order)


def test_admission_is_priority_ordered_and_preemption_takes_the_lowest_priority() -> None:
    kv = KVCacheManager(num_blocks=7, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=64)
    for order, (name, priority) in enumerate([("low", 10), ("late", 20), ("mid", 5), ("urgent", 0)]):
        scheduler.add(make_request(name, 8, priority, order))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["urgent", "mid", "low"]
    for request in batch.requests:  # the prompts are computed; each grows by one token
        request.num_computed_tokens = request.num_tokens
        request.token_ids.append(0)
    # Six blocks are held and one is free: "urgent" takes it, and "mid" gets the blocks of
    # "low", the lowest priority running, rather than being preempted itself.
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.preempted] == ["low"]
    assert [r.request_id for r in batch.requests] == ["urgent", "mid"]
    assert [entry[1].request_id for entry in sorted(scheduler.waiting)] == ["low", "late"]
    kv.check_integrity()


def test_proposals_that_do_not_fit_are_dropped_rather_than_preempting() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    older, newer = make_request("older", 6, 0, 0), make_request("newer", 5, 0, 1)
    for request in (older, newer):
        scheduler.add(request)
    scheduler.schedule()
    for request in (older, newer):  # prompts computed, one token sampled: each holds two blocks
        request.num_computed_tokens = request.num_tokens
        request.token_ids.append(0)
    newer.spec_token_ids = [7, 8, 9]  # its next token fits its blocks; these would need a third
    batch = scheduler.schedule()
    assert not batch.preempted and scheduler.num_preemptions == 0
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [("older", 1), ("newer", 1)]
    assert newer.spec_token_ids == [] and kv.num_free_blocks == 0
    kv.check_integrity()


def test_a_prefix_query_is_counted_once_per_admission() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(make_request("big", 12, 0, 0))
    scheduler.add(make_request("blocked", 12, 0, 1))
    for _ in range(3):  # "blocked" cannot fit; looking again must not count again
        scheduler.schedule()
    assert kv.stats.prefix_queries == 12


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(reference: LLMEngine) -> None:
    engine = engine_like(reference, num_kv_blocks=64)
    prompt = random_ids(random.Random(21), 37)
    [answer] = generate(engine, [prompt], [20])
    engine.add_request("turn-2", prompt + answer + random_ids(random.Random(22), 5), greedy(1))
    while engine.has_unfinished():
        [cached] = {out.num_cached_tokens for out in engine.step()}
    # 57 tokens are shared; the last answer token's K/V is never computed (nothing reads it
    # before the next turn), which costs a block only when prompt + answer fill whole blocks.
    assert cached == (len(prompt) + len(answer)) // 4 * 4


def test_decodes_come_first_and_cap_the_prompt_tokens_of_their_step() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=6)
    long_prompt = make_request("long", 40, 0, 0)
    scheduler.add(long_prompt)
    assert scheduler.schedule().num_new_tokens == [32]  # nothing decodes: the whole budget
    long_prompt.num_computed_tokens = 32
    stream = make_request("stream", 4, 0, 1)
    stream.token_ids.append(0)  # its prompt is computed and it has sampled: it decodes now
    stream.num_computed_tokens = 4
    assert kv.allocate_slots(stream, 4)
    stream.status = RequestStatus.RUNNING
    scheduler.running.append(stream)
    batch = scheduler.schedule()
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [
        ("stream", 1), ("long", 6)]
