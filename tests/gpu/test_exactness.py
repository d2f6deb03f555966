"""The issue's exactness bar on a GPU (skipped without one: the interpreter would take an hour):
for each family at a small size, greedy tokens equal transformers' for 64 tokens in float32, with
64 requests at once (decode graphs of every bucket as the batch drains), chunked prefill, prefix
-cache hits, preemption and resume (a pool too small for them all), the overlap scheduler, and
n-gram speculation; bf16 prompt logprobs off transformers' float32 ones by at most about twice what
transformers' own bf16 ones are."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu.runner import CudaRunner  # noqa: E402
from vivace.models import load_model  # noqa: E402
from tests.models.tiny import save_hf_dir, tiny_model  # noqa: E402

from .conftest import DEVICE  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="64 tokens x 64 requests need a GPU")

KINDS = ["llama", "llama_bias", "qwen2", "mistral", "mistral_sliding", "qwen3", "phi3", "gemma3_pattern2", "granite"]
NEW = 64
# Four prompts, two sharing a 16-token prefix (prefix-cache hits), repeated to 64 requests.
BASE = [5, 90, 31, 242, 77, 12, 5, 90, 31, 242, 77, 12, 40, 41, 42, 43]
PROMPTS = [BASE + [7, 8], BASE + [100, 101, 102], [8, 100, 200, 7], [9] * 11 + [60, 61]]


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    hf = tiny_model(request.param).to(DEVICE)
    path = save_hf_dir(hf.cpu(), tmp_path_factory.mktemp(request.param))
    return str(path), hf.to(DEVICE)


def engine(path: str, blocks: int, weights: torch.dtype = torch.float32, **config: object) -> LLM:
    llm = LLM(path, num_kv_blocks=blocks, block_size=4, max_model_len=128, device="cpu", max_num_seqs=64,
              **config)
    loaded = load_model(path, weights, device=DEVICE)
    spec = int(config.get("num_speculative_tokens", 0))
    llm.engine.runner = CudaRunner(loaded, blocks, 4, weights, 128, device=DEVICE, cuda_graph_max_batch=64,
                                   max_num_seqs=64, verify_batch=4 if spec else 0, verify_tokens=spec,
                                   prefill_graph_tokens=int(config.get("max_num_batched_tokens", 64)))
    assert llm.engine.runner.prefill_graphs is not None  # prompt steps replay graphs (their capture worked)
    return llm


@torch.inference_mode()
def transformers_tokens(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy argmax for ``NEW`` tokens, eos included. Not ``generate(...,
    min_new_tokens=NEW)``: that bans eos, as our ``min_tokens`` does, where our ``ignore_eos``
    neither bans nor stops at it (mistral's PROMPTS[3] has eos, 264, as its argmax at token 19)."""
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(hf(torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax().item())
    return ids[len(prompt):]


@torch.inference_mode()
def transformers_tokens_without_eos(hf, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens with eos banned for all ``NEW`` (its ``min_new_tokens``)."""
    out = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=NEW, min_new_tokens=NEW,
                      do_sample=False)
    return out[0, len(prompt):].tolist()


def test_64_greedy_tokens_equal_transformers_in_every_mode(family) -> None:
    path, hf = family
    want = [transformers_tokens(hf, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    requests = PROMPTS * 16
    # 64 sequences of up to 85 tokens need ~1,400 slots; 200 blocks of 4 force preemptions.
    # A 24-token budget chunks each prompt and mixes chunks with decodes.
    llm = engine(path, 200, max_num_batched_tokens=24)
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    assert got == want * 16
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats.prefix_hits > 0
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2], params)]  # batch 1, the 1-row graph
    assert alone == [want[2]]
    banning = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)  # eos banned on the device
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, banning)]
            == [transformers_tokens_without_eos(hf, p) for p in PROMPTS])
    llm.engine.check_integrity()
    serial = engine(path, 400, overlap_schedule=False)
    assert [o.outputs[0].token_ids for o in serial.generate(PROMPTS, params)] == want
    spec = engine(path, 400, speculative="ngram", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.spec_stats.num_steps > 0


@torch.inference_mode()
def test_bf16_prompt_logprobs_as_near_float32_as_transformers(family) -> None:
    """bf16 rounds at other points in every implementation, and some models amplify it: for the
    tiny Gemma 3 (embeddings times sqrt(hidden), 1 + w norms) transformers' own bf16 logprobs are
    0.1 off its float32 ones, and two bf16 runs can be 0.2 apart. So both bf16 runs are measured
    against transformers' float32 over our top 20 tokens: ours may err at most twice as much as
    transformers' bf16 does, plus 0.02 (a wrong rope, scale or norm errs by far more)."""
    path, hf = family
    ids = torch.tensor([PROMPTS[0]], device=DEVICE)
    truth = hf(ids).logits[0, -1].float().log_softmax(-1)
    theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0, -1].float().log_softmax(-1)
    llm = engine(path, 64, torch.bfloat16, dtype="bfloat16")
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
    top = out.logprobs[0].top
    tokens = torch.tensor([t for t, _, _ in top], device=DEVICE)
    ours = torch.tensor([lp for _, _, lp in top], device=DEVICE)
    our_error = (ours - truth[tokens]).abs().max().item()
    their_error = (theirs[tokens] - truth[tokens]).abs().max().item()
    assert our_error <= 2 * their_error + 0.02, (our_error, their_error)
    assert out.token_ids[0] in truth.topk(3).indices.tolist()
