"""Sliding-window models through the whole engine: greedy output equals transformers', and stays
the same with chunked prefill, prefix caching, speculative verification and compiled decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from vivace import LLM, SamplingParams

from tests.engine.test_compiled import exact_staggered_and_alone

# Gemma 3: sliding, global, sliding (two rope bases); Mistral: every layer sliding.
CONFIGS = {
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, head_dim=16, sliding_window=11, sliding_window_pattern=2, query_pre_attn_scalar=16,
        rope_theta=1e6, rope_local_base_freq=1e4)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=11, head_dim=16)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def sliding_model(request, tmp_path_factory, default_tokenizer_dir: Path) -> tuple[Path, transformers.PreTrainedModel]:
    config_class, extra = CONFIGS[request.param]
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    config = config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=None, initializer_range=0.08, **{"num_hidden_layers": 2, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model


def prompts(count: int, seed: int) -> list[list[int]]:
    """Repetitive prompts (n-gram proposals land) longer than the window."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 9))] for _ in range(count)]
    return [phrase * rng.randrange(3, 6) for phrase in phrases]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_transformers(sliding_model):
    path, hf = sliding_model
    llm = LLM(str(path), num_kv_blocks=128, block_size=4)
    for prompt in prompts(2, seed=1):
        ours = llm.generate(prompt, greedy(20))[0].outputs[0].token_ids
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert ours == theirs[0, len(prompt):].tolist()


def test_chunked_prefill_prefix_cache_and_speculation_keep_outputs(sliding_model):
    path, _ = sliding_model
    shared = prompts(1, seed=2)[0] * 2
    batch = [shared + p for p in prompts(4, seed=3)]
    expected = tokens(LLM(str(path), num_kv_blocks=256, block_size=4).generate(batch, greedy(16)))
    chunked = LLM(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=8, max_prefill_chunk=5)
    first, second = chunked.generate(batch, greedy(16)), chunked.generate(batch, greedy(16))
    assert tokens(first) == expected and tokens(second) == expected
    assert all(o.num_cached_tokens >= len(shared) // 4 * 4 for o in second)
    chunked.check_integrity()
    spec = LLM(str(path), num_kv_blocks=256, block_size=4, speculative="ngram", speculative_max_batch=8)
    assert tokens(spec.generate(batch, greedy(16))) == expected
    assert spec.engine.spec_stats.num_accepted > 0
    spec.check_integrity()


def test_prompt_chunks_past_the_window_riding_compiled_steps_keep_bits(sliding_model):
    """Prompts longer than the window, staggered and alone (``exact_staggered_and_alone``): bit for
    bit, the eager prefill step attending the positions past the window as decodes, as the riding
    rows are."""
    exact_staggered_and_alone(str(sliding_model[0]), prompts(3, seed=5), 10)
