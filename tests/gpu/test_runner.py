"""The CUDA runner behind the engine seam, end to end: greedy tokens of a tiny random Llama equal
transformers' and the CPU runner's, through whole-prompt and chunked prefill, prefix-cache hits,
mixed batches and n-gram verification rows (on CPU under Triton's interpreter where there is no
GPU: few tokens, tiny model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu.runner import CudaRunner, graph_buckets  # noqa: E402
from vivace.models import load_model  # noqa: E402

from .conftest import DEVICE  # noqa: E402

PROMPTS = [[5, 900, 31, 4242, 77, 12, 5, 900, 31, 4242, 77, 12, 5, 900], [8, 1000, 20000, 7]]
NEW = 6


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def with_cuda_runner(llm: LLM, model_dir: str) -> LLM:
    """``llm`` with its runner replaced by a CudaRunner on DEVICE over a fresh copy of the weights
    (the CPU engine repacks its own for the native GEMM)."""
    engine = llm.engine
    loaded = load_model(model_dir, torch.float32, device=DEVICE)
    engine.runner = CudaRunner(loaded, len(engine.kv.blocks), engine.kv.block_size, torch.float32,
                               engine.max_model_len, device=DEVICE)
    return llm


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_greedy_equals_transformers_and_the_cpu_runner(tiny_model_dir, hf) -> None:
    # A 5-token budget: the 14-token prompt prefills in chunks, riding with the other's decodes.
    config = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=5, max_model_len=64, device="cpu")
    gpu = with_cuda_runner(LLM(str(tiny_model_dir), **config), str(tiny_model_dir))
    ours = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, greedy())]
    for prompt, tokens in zip(PROMPTS, ours):
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert tokens == theirs[0, len(prompt):].tolist()
    cpu = LLM(str(tiny_model_dir), **config)
    assert [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy())] == ours
    # Again: the prompts' full blocks now come from the prefix cache.
    again = gpu.generate(PROMPTS[0], greedy())[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == ours[0]
    gpu.engine.check_integrity()
    assert gpu.engine.kv.num_free_blocks == 32


def test_ngram_verification_rows_keep_greedy_tokens(tiny_model_dir) -> None:
    config = dict(num_kv_blocks=32, block_size=4, max_model_len=64, device="cpu")
    plain = LLM(str(tiny_model_dir), **config).generate(PROMPTS[0], greedy())[0].outputs[0].token_ids
    spec = with_cuda_runner(LLM(str(tiny_model_dir), speculative="ngram", num_speculative_tokens=2, **config),
                            str(tiny_model_dir))
    assert spec.generate(PROMPTS[0], greedy())[0].outputs[0].token_ids == plain
    assert spec.engine.spec_stats.num_steps > 0


def test_graph_buckets() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_across_buckets(tiny_model_dir) -> None:
    config = dict(num_kv_blocks=64, block_size=16, max_model_len=128, device="cpu")
    eager = with_cuda_runner(LLM(str(tiny_model_dir), **config), str(tiny_model_dir))
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS * 3, greedy())]
    graphed = LLM(str(tiny_model_dir), **config)
    loaded = load_model(str(tiny_model_dir), torch.float32, device="cuda")
    graphed.engine.runner = CudaRunner(loaded, 64, 16, torch.float32, 128, device="cuda", cuda_graph_max_batch=8)
    assert [o.outputs[0].token_ids for o in graphed.generate(PROMPTS * 3, greedy())] == want
