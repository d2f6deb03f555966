"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and requests for no tokens (``max_tokens``
0): equal to transformers' float32 log-softmax of the prompt's logits, whatever the chunking,
the prefix cache, preemption, speculation, logit bias, a grammar or the rest of the batch."""

from __future__ import annotations

import random

import pytest
import torch

from vivace import LLM, FinishReason, SamplingParams
from vivace.engine.outputs import TokenLogprob
from vivace.engine.sampling_params import StructuredOutput

TOL = 1e-4
# A float32 KV cache: the default (float16 on CPU) would differ from transformers by ~5e-4.
CONFIG = dict(block_size=4, kv_cache_dtype="float32")


def prompts(count: int, seed: int, low: int = 20, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def scored(num_top: int = 2, max_tokens: int = 3, **params: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=num_top, **params)


def greedy(max_tokens: int = 3, **params: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """Chunks of at most 16 tokens, prefix caching on."""
    engine = LLM(str(tiny_model_dir), num_kv_blocks=128, max_num_batched_tokens=16, **CONFIG)
    yield engine
    engine.check_integrity()


@pytest.fixture(autouse=True)
def _pool_is_whole(llm):
    yield
    kv = llm.engine.kv
    assert kv.num_free_blocks == len(kv.blocks)
    llm.check_integrity()


@torch.inference_mode()
def assert_like_transformers(hf, prompt: list[int], entries: list[TokenLogprob | None], num_top: int) -> None:
    """``entries`` are the log-softmax of transformers' float32 logits: each prompt token's logprob and
    rank, and its ``num_top`` most likely alternatives (in order; near-ties may swap)."""
    reference = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        row, token = reference[position], prompt[position + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) <= TOL
        above = int((row > row[token] + TOL).sum()), int((row > row[token] - TOL).sum())
        assert above[0] + 1 <= entry.rank <= above[1] + 1
        assert len(entry.top) == num_top
        want = row.topk(num_top).values.tolist()
        for (top_id, _, logprob), expected in zip(entry.top, want):
            assert abs(logprob - expected) <= TOL and abs(row[top_id].item() - logprob) <= TOL


def texts(entries: list[TokenLogprob | None]) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in entries[1:]]


def test_chunked_prompt_logprobs_equal_transformers(llm, hf_tiny_llama):
    prompt = prompts(1, seed=1, low=45, high=46)[0]
    out = llm.generate(prompt, scored(num_top=3))[0]
    assert len(out.timings.prefill_chunks) >= 3  # 45 tokens in chunks of at most 16
    assert_like_transformers(hf_tiny_llama, prompt, out.prompt_logprobs, 3)
    assert out.outputs[0].token_ids == llm.generate(prompt, greedy())[0].outputs[0].token_ids
    assert llm.generate(prompt, greedy())[0].prompt_logprobs is None


def test_a_prefix_cache_hit_does_not_cut_the_prompt_logprobs(llm, hf_tiny_llama):
    prompt = prompts(1, seed=2, low=40, high=41)[0]
    llm.generate(prompt, greedy())  # its full blocks are cached now
    first = llm.generate(prompt, scored(num_top=0))[0]
    assert first.num_cached_tokens == 0
    assert_like_transformers(hf_tiny_llama, prompt, first.prompt_logprobs, 0)
    again = llm.generate(prompt, scored(num_top=0))[0]
    assert texts(again.prompt_logprobs) == texts(first.prompt_logprobs)
    assert llm.generate(prompt, greedy())[0].num_cached_tokens >= 36  # they publish their blocks still


def test_prompt_logprobs_survive_preemption(tiny_model_dir, hf_tiny_llama, llm, monkeypatch):
    batch = prompts(4, seed=3, low=40, high=60)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, greedy(12))]
    small = LLM(str(tiny_model_dir), num_kv_blocks=24, max_num_batched_tokens=16, **CONFIG)
    scheduler = small.engine.scheduler
    preempted = []  # (prompt logprobs collected, prompt tokens) of each victim

    def preempt(victim, step_batch, original=scheduler._preempt):
        if victim.prompt_logprobs is not None:
            preempted.append((len(victim.prompt_logprobs), victim.num_prompt_tokens))
        original(victim, step_batch)
    monkeypatch.setattr(scheduler, "_preempt", preempt)
    outputs = small.generate(batch, scored(num_top=1, max_tokens=12))
    assert any(1 < collected < total for collected, total in preempted), preempted  # some mid-prompt
    assert small.engine.kv.stats.prefix_hits > 0  # resumed from the blocks before their first unscored position
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(batch, outputs):
        assert_like_transformers(hf_tiny_llama, prompt, out.prompt_logprobs, 1)
    small.check_integrity()
    assert small.engine.kv.num_free_blocks == 24


def test_other_requests_of_the_batch_are_unchanged(llm, hf_tiny_llama):
    """Beside requests with prompt logprobs (one with a logit bias, one with a grammar: neither
    touches the prompt's rows), plain requests get the tokens and logprobs they get alone."""
    batch = prompts(4, seed=4)
    plain = [greedy(6, logprobs=2), SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=1)]
    alone = [llm.generate(p, sp)[0].outputs[0] for p, sp in zip(batch[:2], plain)]
    bias = {batch[2][5]: -100.0, batch[2][9]: 100.0}
    regex = StructuredOutput("regex", r"[a-z]{3}")
    mixed = llm.generate(batch, plain + [scored(logit_bias=bias), scored(structured=regex, max_tokens=8)])
    for got, want in zip(mixed, alone):
        assert got.prompt_logprobs is None
        assert got.outputs[0].token_ids == want.token_ids
        for mine, theirs in zip(got.outputs[0].logprobs, want.logprobs, strict=True):  # batch shapes round apart
            assert [t for t, _, _ in mine.top] == [t for t, _, _ in theirs.top]
            assert abs(mine.logprob - theirs.logprob) <= 1e-5
    for prompt, out in zip(batch[2:], mixed[2:]):
        assert_like_transformers(hf_tiny_llama, prompt, out.prompt_logprobs, 2)
    assert mixed[2].outputs[0].token_ids[0] == batch[2][9]  # the bias did apply to the sampled token


def test_speculation_leaves_prompt_logprobs_alone(tiny_model_dir, hf_tiny_llama):
    spec = LLM(str(tiny_model_dir), num_kv_blocks=128, speculative="ngram", num_speculative_tokens=3, **CONFIG)
    base = prompts(1, seed=5, low=12, high=13)[0]
    prompt = base * 3  # repetitive: n-gram proposals
    out = spec.generate(prompt, scored(max_tokens=20))[0]
    assert_like_transformers(hf_tiny_llama, prompt, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == spec.generate(prompt, greedy(20))[0].outputs[0].token_ids
    assert spec.engine.spec_stats.num_steps > 0
    spec.check_integrity()


def test_no_tokens_asked_for_ends_after_the_prompt(llm, hf_tiny_llama):
    batch = prompts(3, seed=6)
    outputs = llm.generate(batch, [scored(max_tokens=0), greedy(0, logprobs=1), greedy(5)])
    for out in outputs[:2]:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == FinishReason.LENGTH
        assert completion.token_ids == [] and completion.text == ""
        assert out.timings.first_token is None and out.timings.finished is not None
    assert outputs[1].outputs[0].logprobs == [] and outputs[1].prompt_logprobs is None
    assert_like_transformers(hf_tiny_llama, batch[0], outputs[0].prompt_logprobs, 2)
    assert len(outputs[2].outputs[0].token_ids) == 5
    one = llm.generate([7], scored(max_tokens=0))[0]  # one prompt token: nothing to score
    assert one.prompt_logprobs == [None] and one.outputs[0].finish_reason == FinishReason.LENGTH


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
