"""The engine on a tiny random Llama: exact against transformers, whatever the batch."""

import random

import pytest
import torch

from vivace import LLM, FinishReason, SamplingParams


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4)
    yield engine
    engine.check_integrity()
    assert engine.engine.kv.num_free_blocks == 256


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_transformers(llm, hf_tiny_llama):
    for prompt in prompts(3, seed=1):
        # min_tokens masks eos exactly as transformers' min_new_tokens does.
        ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=24))[0].outputs[0].token_ids
        ids = torch.tensor([prompt])
        theirs = hf_tiny_llama.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert ours == theirs[0, len(prompt):].tolist()


def test_batch_of_16_equals_each_alone(llm):
    batch = prompts(16, seed=2)
    params = [greedy(5 + 3 * i) for i in range(16)]
    together = tokens(llm.generate(batch, params))
    alone = [tokens(llm.generate(p, sp))[0] for p, sp in zip(batch, params)]
    assert together == alone
    assert [len(t) for t in together] == [p.max_tokens for p in params]


def test_preemption_in_a_tiny_pool_keeps_outputs(tiny_model_dir, llm):
    batch = prompts(8, seed=3)
    expected = tokens(llm.generate(batch, greedy(40)))
    small = LLM(str(tiny_model_dir), num_kv_blocks=40, block_size=4, enable_prefix_caching=False)
    outputs = small.generate(batch, greedy(40))
    assert tokens(outputs) == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(len(o.timings.preemptions) for o in outputs) == small.engine.scheduler.num_preemptions
    small.check_integrity()
    assert small.engine.kv.num_free_blocks == 40


def test_chunked_prefill_and_prefix_cache_keep_outputs(tiny_model_dir, llm):
    shared = prompts(1, seed=4)[0] * 3
    batch = [shared + p for p in prompts(4, seed=5)]
    expected = tokens(llm.generate(batch, greedy(12)))
    chunked = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    first = chunked.generate(batch, greedy(12))
    second = chunked.generate(batch, greedy(12))
    assert tokens(first) == expected and tokens(second) == expected
    for out in first:  # each prompt chunk is in the timings: (step start, tokens)
        chunks = out.timings.prefill_chunks
        assert len(chunks) > 1 and all(size <= 16 for _, size in chunks)
        assert sum(size for _, size in chunks) == out.prompt_tokens - out.num_cached_tokens
    assert all(o.num_cached_tokens >= len(shared) // 4 * 4 for o in second)
    chunked.check_integrity()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_prefix_hit_on_an_earlier_answer_keeps_greedy_tokens_and_logprobs(tiny_model_dir, quantization):
    """Multi-turn chat: turn 2's prompt holds turn 1's answer, whose K/V were made under hidden states
    the decode kernel attended. Sent to the engine that wrote them (a prefix-cache hit on the answer's
    blocks) and to a fresh one (a miss: the prefill kernel attends those positions as prompt), it
    gets the same greedy tokens and logprobs: bit for bit with float activations (any last-bit
    difference would show in the logprobs), and with int8-quantized ones (where one can move a code)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    options = dict(num_kv_blocks=256, block_size=4, quantization=quantization)
    for seed in (21, 22):
        turn1 = prompts(1, seed=seed)[0]
        chat = LLM(str(tiny_model_dir), **options)
        answer = chat.generate(turn1, params)[0].outputs[0].token_ids
        turn2 = turn1 + answer + prompts(1, seed=seed + 100)[0]
        hit = chat.generate(turn2, params)[0]
        miss = LLM(str(tiny_model_dir), **options).generate(turn2, params)[0]
        assert hit.num_cached_tokens >= (len(turn1) + len(answer) - 1) // 4 * 4 > len(turn1)
        assert miss.num_cached_tokens == 0
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
        assert [lp.logprob for lp in hit.outputs[0].logprobs] == [lp.logprob for lp in miss.outputs[0].logprobs]
        chat.check_integrity()


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    for i, prompt in enumerate(prompts(4, seed=6)):
        engine.add_request(f"abort-{i}", prompt, greedy(50))
    for _ in range(5):
        engine.step()
    ended = [engine.abort_request(f"abort-{i}") for i in range(4)]
    assert all(o.finished and o.outputs[0].finish_reason == FinishReason.ABORT for o in ended)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.kv.num_free_blocks == len(engine.kv.blocks)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)
    target = prompts(1, seed=7)[0]
    alone = tokens(llm.generate(target, params))[0]
    mixed = tokens(llm.generate([target] + prompts(5, seed=8), [params] + [noise] * 5))[0]
    assert alone == mixed
    other_seed = SamplingParams(temperature=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert tokens(llm.generate(target, other_seed))[0] != alone


def test_stop_string_and_finish_reasons(llm):
    prompt = prompts(1, seed=9)[0]
    full = llm.generate(prompt, greedy(30))[0].outputs[0]
    assert full.finish_reason == FinishReason.LENGTH and len(full.token_ids) == 30
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip(), "the tiny model should produce visible text"
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]


def test_n_choices_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate(prompts(1, seed=10)[0], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for choice in out.outputs:
        assert len(choice.logprobs) == 8
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in choice.logprobs)
        assert [lp.token_id for lp in choice.logprobs] == choice.token_ids


def test_prompt_that_does_not_fit_is_rejected(llm):
    with pytest.raises(ValueError, match="1000 prompt tokens plus 100"):
        llm.generate([5] * 1000, greedy(100))
    llm.check_integrity()


def test_stop_token_text_is_kept_only_with_include_stop_str_in_output(llm):
    """As vLLM: a stop token id's text is left out of the output unless include_stop_str_in_output."""
    prompt = prompts(1, seed=9)[0]
    ids = llm.generate(prompt, greedy(12))[0].outputs[0].token_ids
    at = next(i for i in range(3, 12) if ids[i] not in ids[:i])
    before, through = (llm.generate(prompt, greedy(n))[0].outputs[0].text for n in (at, at + 1))
    for include, text in ((False, before), (True, through)):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[ids[at]],
                                include_stop_str_in_output=include)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert (out.text, out.token_ids, out.stop_reason) == (text, ids[:at + 1], ids[at])


def test_stop_strings_end_the_output_only_after_min_tokens(llm):
    """As vLLM (and as eos and stop token ids): the tokens up to min_tokens can't complete a stop string."""
    prompt = prompts(1, seed=9)[0]
    first_three = llm.generate(prompt, greedy(3))[0].outputs[0]
    stop = first_three.text[-2:]
    assert stop not in first_three.text[:-1], "the stop string should first be completed by the third token"
    early = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=[stop], min_tokens=2)
    assert llm.generate(prompt, early)[0].outputs[0].token_ids == first_three.token_ids
    late = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=[stop], min_tokens=3)
    assert len(llm.generate(prompt, late)[0].outputs[0].token_ids) == 4
