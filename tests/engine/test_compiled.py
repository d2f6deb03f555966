"""Compiled decode steps (padded to a compiled batch size) against eager ones, on the tiny Llama."""

import random

import pytest
import torch

from vivace import LLM, SamplingParams
from vivace.config import EngineConfig
from vivace.engine.compiled import CompiledDecoder
from vivace.engine.runner import ModelRunner
from vivace.models import load_model

SIZES = (4,)  # one small graph keeps the compile short; batches of 1-3 are padded, 5+ run eagerly


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), torch.float32)


@pytest.fixture(scope="module")
def compiled_runner(loaded):
    return ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32,
                       max_model_len=64, compile_batch_sizes=SIZES)


def test_greedy_tokens_equal_eager_as_the_batch_shrinks(tiny_model_dir, monkeypatch):
    calls = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: calls.append(len(a[0])) or original(self, *a))
    batch = prompts(6, seed=1)
    # Different lengths: batches go 6 and 5 (eager), 4, then 3, 2, 1 (padded to 4).
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    eager = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4)
    compiled = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, compile=True, compile_batch_sizes=SIZES)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert [o.outputs[0].token_ids for o in compiled.generate(batch, params)] == expected
    assert calls and set(calls) == {4}
    for llm in (eager, compiled):
        llm.check_integrity()
        assert llm.engine.kv.num_free_blocks == 128


def test_padding_rows_touch_only_the_scratch_block(compiled_runner):
    runner = compiled_runner
    for cache in runner.kv_caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in runner.kv_caches]
    with torch.inference_mode():
        runner.decode([7], [5], [[3, 9]])  # one sequence: its 6th token lands in block 9, offset 1
    touched = torch.zeros(runner.kv_caches[0].shape[1], runner.kv_caches[0].shape[2], dtype=torch.bool)
    touched[9, 1] = True
    touched[runner.scratch_block] = True
    for cache, old in zip(runner.kv_caches, before):
        changed = (cache != old).any(dim=(0, 3, 4))
        assert changed[9, 1] and not (changed & ~touched).any()


def test_compiled_logits_match_eager_and_ignore_padding(loaded, compiled_runner):
    eager = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32)
    for cache, source in zip(eager.kv_caches, compiled_runner.kv_caches):
        cache.copy_(source)
    tables = [[0, 1, 2], [4, 5], [6]]
    with torch.inference_mode():
        ours = compiled_runner.decode([11, 12, 13], [9, 6, 2], tables)
        theirs = eager.decode([11, 12, 13], [9, 6, 2], tables)
    assert ours.shape == (3, loaded.config.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    real = eager.scratch_block  # blocks the pool hands out; the scratch block comes after them
    for cache, other in zip(compiled_runner.kv_caches, eager.kv_caches):
        torch.testing.assert_close(cache[:, :real], other[:, :real])


def test_decode_batch_sizes_stop_at_the_first_that_holds_max_num_seqs():
    assert EngineConfig().decode_batch_sizes == ()
    assert EngineConfig(compile=True, max_num_seqs=5).decode_batch_sizes == (1, 2, 4, 8)
    assert EngineConfig(compile=True, max_num_seqs=64).decode_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert EngineConfig(compile=True, max_num_seqs=100).decode_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    with pytest.raises(ValueError, match="compile_batch_sizes"):
        EngineConfig(compile_batch_sizes=(0, 4))
