"""One request's failure ends that request alone: the other rows of its step get exactly the
tokens they get without it, and every KV block returns to the pool."""

import random

import pytest
import torch

from vivace import LLM, FinishReason, SamplingParams

POISON = 1234  # a token id whose embedding row is NaN in the poisoned model
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def poisoned(make_tiny_llama):
    """A tiny Llama whose rows turn NaN wherever the prompt holds POISON (untied embeddings, so
    the LM head stays finite for everyone else)."""
    llm = LLM(str(make_tiny_llama(seed=3, tie_word_embeddings=False)), num_kv_blocks=NUM_BLOCKS,
              block_size=4)
    with torch.no_grad():
        llm.engine.loaded.model.embed_tokens.weight[POISON] = float("nan")
    yield llm
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == NUM_BLOCKS


def healthy_prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    result = llm.generate(prompts, params)
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == NUM_BLOCKS
    return result


@pytest.mark.parametrize("poison_at", [0, 2, 4])
def test_a_row_with_nan_logits_ends_only_its_request(poisoned, poison_at):
    prompts = healthy_prompts(4)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True)]
    alone = outputs(poisoned, prompts, params)
    bad_prompt = [5, 6, POISON, 7]
    mixed = outputs(poisoned, prompts[:poison_at] + [bad_prompt] + prompts[poison_at:],
                    params[:poison_at] + [SamplingParams(max_tokens=8)] + params[poison_at:])
    failed = mixed.pop(poison_at)
    assert failed.finished and "non-finite logits" in failed.error
    assert failed.outputs[0].finish_reason == FinishReason.ABORT and failed.outputs[0].token_ids == []
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert all(o.error is None for o in mixed)
    # Logprobs match to float noise: a different batch shape sums in another order.
    ours, theirs = mixed[2].outputs[0].logprobs, alone[2].outputs[0].logprobs
    assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-4)


def test_the_engine_goes_on_serving_after_a_failure(poisoned):
    prompt = healthy_prompts(1)[0]
    before = outputs(poisoned, [prompt], [SamplingParams(temperature=0, max_tokens=6)])[0]
    assert outputs(poisoned, [[POISON] * 9], [SamplingParams(max_tokens=3)])[0].error
    after = outputs(poisoned, [prompt], [SamplingParams(temperature=0, max_tokens=6)])[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
