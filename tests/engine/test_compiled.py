"""Compiled decode steps against eager ones, on the tiny Llama."""

import random

import pytest
import torch
import transformers

from vivace import LLM, SamplingParams
from vivace.engine.compiled import CompiledDecoder
from vivace.engine.runner import ModelRunner
from vivace.layers.packed_linear import prepack_linears
from vivace.models import load_model

from tests.engine.test_pacer import fixed_model

MAX_BATCH = 4  # batches of 5 and more decode eagerly


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), torch.float32)
    prepack_linears(loaded.model)
    return loaded


@pytest.fixture(scope="module")
def compiled_runner(loaded):
    return ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32, max_model_len=64,
                       compile_max_batch=MAX_BATCH)


def test_greedy_tokens_equal_eager_as_the_batch_shrinks(tiny_model_dir, monkeypatch):
    calls = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: calls.append(len(a[0])) or original(self, *a))
    batch = prompts(6, seed=1)
    # Different lengths: decode batches go 6 and 5 (eager), then 4, 3, 2 and 1 (compiled).
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    eager = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4)
    compiled = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, compile=True, max_num_seqs=MAX_BATCH)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    with torch.compiler.set_stance("fail_on_recompile"):  # warm-up compiled every graph a step needs
        outputs = compiled.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert set(calls) == {1, 2, 3, 4}
    for llm in (eager, compiled):
        llm.check_integrity()
        assert llm.engine.kv.num_free_blocks == 128


def test_a_head_size_the_native_kernel_lacks_decodes_as_transformers(make_tiny_llama):
    """Heads of 24 dims (the native decode kernel is built for multiples of 16): eager and compiled
    decode steps take the reference op and give transformers' greedy tokens; the first decode step
    of such a model failed ('head_dim must be a multiple of 16')."""
    path = make_tiny_llama(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(3, seed=5)
    expected = [reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                                   min_new_tokens=8)[0, len(ids):].tolist() for ids in batch]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for compile_ in (False, True):
        llm = LLM(str(path), num_kv_blocks=64, block_size=4, compile=compile_, max_num_seqs=MAX_BATCH)
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == expected
        llm.check_integrity()


def test_quantized_linears_compile_and_keep_greedy_tokens(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = prompts(3, seed=2)
    eager = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, quantization="int8")
    compiled = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, quantization="int8", compile=True,
                   max_num_seqs=MAX_BATCH)
    assert compiled.engine.runner.decoder.backend == "aot"  # weights are plain tensors: a package serves
    with torch.compiler.set_stance("fail_on_recompile"):
        outputs = compiled.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager.generate(batch, params)]


def test_quantized_compiled_steps_are_bit_identical_to_eager(tiny_model_dir):
    """With int8 activations a last-bit difference can move a code, grow through the layers and
    change a greedy token depending on whether a row ran compiled or eager (on its batch): the
    compiled step must compute exactly what the eager one does, over real K/V (positions past 0,
    where attention mixes several values)."""
    loaded = load_model(str(tiny_model_dir), torch.float32, "int8")
    prepack_linears(loaded.model)
    # MAX_BATCH rows and block size 4, as test_quantized_linears_compile_and_keep_greedy_tokens: one package.
    compiled = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32, compile_max_batch=MAX_BATCH)
    eager = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32)
    assert compiled.decoder is not None and compiled.decoder.backend == "aot"
    rng = random.Random(7)
    tables = [[0, 1, 2], [3, 4], [5]]
    with torch.inference_mode():
        for position in range(12):
            rows = [table for table in tables if position < 4 * len(table)]
            ids = [rng.randrange(3, 49152) for _ in rows]
            ours = compiled.decode(ids, [position] * len(rows), rows)
            theirs = eager.decode(ids, [position] * len(rows), rows)
            assert torch.equal(ours, theirs), f"position {position}: {(ours - theirs).abs().max().item()}"


def test_decode_writes_only_its_own_slot(compiled_runner):
    runner = compiled_runner
    assert runner.decoder.backend == "dynamo"  # oneDNN-prepacked float weights: no package
    for cache in runner.kv_caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in runner.kv_caches]
    with torch.inference_mode():
        runner.decode([7, 8], [5, 0], [[3, 9], [4]])  # tokens 6 of blocks 3, 9 and 1 of block 4
    for cache, old in zip(runner.kv_caches, before):
        changed = (cache != old).any(dim=(0, 3, 4))
        assert changed.nonzero().tolist() == [[4, 0], [9, 1]]


@pytest.mark.parametrize("num_seqs", [1, 3, MAX_BATCH + 1])
def test_decode_logits_match_the_eager_runner(loaded, compiled_runner, num_seqs):
    eager = ModelRunner(loaded, num_blocks=16, block_size=4, kv_dtype=torch.float32)
    for cache, source in zip(eager.kv_caches, compiled_runner.kv_caches):
        cache.copy_(source)
    tables = [[0, 1, 2], [4, 5], [6], [7, 8], [10, 11, 12, 13]][:num_seqs]
    positions = [9, 6, 2, 5, 15][:num_seqs]
    with torch.inference_mode():
        ours = compiled_runner.decode(list(range(11, 11 + num_seqs)), positions, tables)
        theirs = eager.decode(list(range(11, 11 + num_seqs)), positions, tables)
    assert ours.shape == (num_seqs, loaded.config.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for cache, other in zip(compiled_runner.kv_caches, eager.kv_caches):
        torch.testing.assert_close(cache, other)


def test_verify_steps_run_compiled_and_keep_greedy_tokens(tiny_model_dir, monkeypatch):
    """A proposal's rows are decode rows: batch-1 verify steps go through the compiled graph."""
    rows = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: rows.append(len(a[0])) or original(self, *a))
    rng = random.Random(5)
    batch = [[rng.randrange(3, 49152) for _ in range(6)] * 4 for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, quantization="int8")
    spec = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, quantization="int8", compile=True,
               max_num_seqs=MAX_BATCH, speculative="ngram", num_speculative_tokens=3)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = [spec.generate(prompt, params)[0].outputs[0].token_ids for prompt in batch]
    assert got == [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert spec.engine.spec_stats.num_accepted > 0 and max(rows) > 1
    spec.check_integrity()
    assert spec.engine.kv.num_free_blocks == 64


def test_prompt_chunks_beside_decodes_ride_the_compiled_step(tiny_model_dir, monkeypatch):
    """A step of decodes plus a short prompt chunk runs as compiled decode rows (not eagerly);
    greedy tokens stay those of an eager engine."""
    rows = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: rows.append(len(a[0])) or original(self, *a))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = prompts(3, seed=11)
    eager = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, quantization="int8")
    compiled = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, quantization="int8", compile=True,
                   max_num_seqs=8, max_prefill_chunk=3)
    engine = compiled.engine
    outputs = {}
    engine.add_request("first", batch[0], params)
    steps = [engine.step()]  # its whole prompt (nothing decodes yet), then it decodes beside the others' chunks
    for i, prompt in enumerate(batch[1:]):
        engine.add_request(f"later-{i}", prompt, params)
    while engine.has_unfinished():
        steps.append(engine.step())
    for step in steps:
        for out in step:
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert [outputs["first"], outputs["later-0"], outputs["later-1"]] == expected
    assert max(rows) >= 4  # decodes plus a 3-token chunk (three decodes alone are 3 rows)
    compiled.check_integrity()


def exact_staggered_and_alone(path: str, batch: list[list[int]], max_tokens: int) -> None:
    """Asserts that greedy tokens and their logprobs are bit for bit the same when ``batch``'s prompts
    arrive one every two steps at a compiled engine (int8 activations, batch_invariant), their
    chunks of 3 tokens riding compiled steps beside the others' decodes, as when each runs alone
    on an eager engine (its whole prompt in one step on the prefill path)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    eager = LLM(path, num_kv_blocks=256, block_size=4, quantization="int8")
    compiled = LLM(path, num_kv_blocks=256, block_size=4, quantization="int8", compile=True, max_num_seqs=8,
                   max_prefill_chunk=3, batch_invariant=True)
    engine = compiled.engine
    outputs: dict[str, list] = {}
    for step in range(300):
        if step < 2 * len(batch) and step % 2 == 0:
            engine.add_request(str(step // 2), batch[step // 2], params)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].logprobs)
        if step >= 2 * len(batch) and not engine.has_unfinished():
            break
    for i, prompt in enumerate(batch):
        alone = eager.generate(prompt, params)[0].outputs[0].logprobs
        assert [(lp.token_id, lp.logprob) for lp in outputs[str(i)]] == [(lp.token_id, lp.logprob) for lp in alone]
    compiled.check_integrity()


def test_prompt_chunks_riding_the_compiled_step_get_a_prefill_steps_bits(tiny_model_dir):
    """With batch_invariant, greedy tokens and their logprobs, bit for bit, staggered and alone
    (``exact_staggered_and_alone``). With int8 activations a last-bit difference in a prompt row's attention moves codes: it shows in the logprobs here and
    changes greedy tokens on a real model."""
    exact_staggered_and_alone(str(tiny_model_dir), prompts(3, seed=13), 12)


def test_the_pacer_sends_deep_chunks_to_the_prefill_path_and_keeps_greedy_tokens(tiny_model_dir):
    """With costs that make a row dear the deeper it is, chunks at a prompt's start ride the
    compiled step and deeper ones take the prefill path beside the decode rows; greedy tokens
    stay those of an eager engine."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rng = random.Random(12)
    batch = [[rng.randrange(3, 49152) for _ in range(length)] for length in (5, 60, 60)]
    eager = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, quantization="int8")
    # 8 rows, as the test above: the same package, compiled once (~20 s in a cold cache).
    compiled = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, quantization="int8", compile=True,
                   max_num_seqs=8)
    engine = compiled.engine
    # 4 ms + 0.25 ms a decode; a row 0.1 ms + 100 ms per thousand positions (short runs or long);
    # the prefill path 3 ms + 0.3 ms a token. Beside one decode (4.25 ms of room): ~8 rows at a
    # prompt's start against 4 tokens on the prefill path; past position ~20 fewer than 4 rows fit,
    # and the prefill path's 4 win.
    engine.scheduler.pacer.model = fixed_model((0.004, 0.00025, 0.0001, 0.1, 0.1, 0.003, 0.0003, 0.0))
    outputs: dict[str, list[int]] = {}
    engine.add_request("first", batch[0], params)
    for step in range(200):
        if step in (2, 4):
            engine.add_request(f"later-{step}", batch[step // 2], params)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if not engine.has_unfinished():
            break
    expected = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert [outputs["first"], outputs["later-2"], outputs["later-4"]] == expected
    paths = {s["path"] for s in engine.timings.steps.rows() if s["decode_tokens"] and s["prompt_tokens"]}
    assert paths == {"rows", "prefill"}
    compiled.check_integrity()
