"""The float8 (e4m3) KV cache, ``--kv-cache-dtype fp8``: the rotary + K/V write quantizes exactly as
torch does (divide by the head's scale, clamp to +-448, round to nearest even); decode and prefill
attention (a prompt step's decode rows through the decode kernel too) over a float8 cache equal a
float32 reference over the dequantized cache (tight) and stay near one over the unquantized values
(loose); scales from a checkpoint or from calibration; a tiny
Llama through the CUDA runner with a float8 cache decodes as with a float32 one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from safetensors.torch import save_file  # noqa: E402

from vivace import LLM, SamplingParams  # noqa: E402
from vivace.gpu import kernels, kv_fp8  # noqa: E402
from vivace.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

from .conftest import DEVICE  # noqa: E402
from .test_kernels import (BLOCK, as_tensor, gather, prompt_step_attention, random_cache, reference,  # noqa: E402
                           tables_for)
from .test_runner import with_cuda_runner  # noqa: E402

FP8 = torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's quantization of ``x`` ``[..., kv_heads, head_dim]`` by per-head ``scale``."""
    return (x / scale[:, None]).clamp(-448, 448).to(FP8)


def dequantize(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return cache.float() * scales[:, None, None, :, None]


def fp8_cache(num_blocks: int, kv_heads: int, head_dim: int, scales: torch.Tensor, seed: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(unquantized float32 cache, its float8 quantization) of random values of about each head's
    scale times 20, one head far larger than the others."""
    values = random_cache(num_blocks, kv_heads, head_dim, seed) * 20 * scales[:, None, None, :, None]
    quantized = torch.stack([quantize(values[i], scales[i]) for i in (0, 1)])
    return values, quantized


def test_rotary_kv_write_quantizes_as_torch() -> None:
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 6
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, torch.float32)
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    g = torch.Generator().manual_seed(20)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 40).to(DEVICE)
    # Head 0's values at scale 1: ties (17 -> 16, 19 -> 20), a carry into the exponent (31.5 -> 32),
    # subnormals, zero, and values past 448 that must saturate.
    v0 = (heads + kv_heads) * head_dim
    special = [17.0, 19.0, 31.5, 0.001, -0.0037, 0.0, 1000.0, -5000.0, 447.9, 460.0]
    qkv[0, v0:v0 + len(special)] = torch.tensor(special, device=DEVICE)
    scales = torch.tensor([[0.375, 2.0], [1.0, 0.3]], device=DEVICE)  # keys', values'; not all powers of two
    positions = torch.tensor([0, 3, 17, 40, 63, 9], device=DEVICE)
    slots = torch.tensor([5, 0, 31, 12, 7, 22], device=DEVICE)
    cache = torch.zeros(2, 8, BLOCK, kv_heads, head_dim, dtype=FP8, device=DEVICE)
    q = kernels.rotary_kv_write(qkv, cos, sin, positions, slots, cache, heads, kv_scale=scales)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    torch.testing.assert_close(q, apply_rotary(q_ref.reshape(tokens, heads, head_dim), c, s))
    flat = cache.view(2, -1, kv_heads, head_dim)
    k_want = quantize(apply_rotary(k_ref.reshape(tokens, kv_heads, head_dim), c, s), scales[0])
    v_want = quantize(v_ref.reshape(tokens, kv_heads, head_dim), scales[1])
    assert torch.equal(flat[0, slots].float(), k_want.float())
    assert torch.equal(flat[1, slots].float(), v_want.float())
    assert flat[1, 5, 0, :len(special)].float().tolist() == [16, 20, 32, 0.001953125, -0.00390625, 0, 448, -448,
                                                             448, 448]
    assert not flat.float().isnan().any()


@pytest.mark.parametrize("q_dtype, splits, window, head_dim", [
    (torch.float32, 1, None, 32), (torch.float32, 3, 5, 32), (torch.bfloat16, 2, None, 32),
    (torch.float16, 1, 7, 32), (torch.bfloat16, 1, None, 20)])
def test_paged_decode_attention_over_fp8(q_dtype: torch.dtype, splits: int, window: int | None,
                                         head_dim: int) -> None:
    """16-bit queries over whole words of codes (head_dim a multiple of 8) read the cache as int32
    words and multiply in float16 (``kernels._e4m3_tile``); otherwise the codes one by one."""
    heads, kv_heads, lengths = 6, 2, [1, 7, 19]
    scales = torch.tensor([[0.25, 4.0], [0.5, 0.3]], device=DEVICE)
    values, cache = fp8_cache(16, kv_heads, head_dim, scales, seed=21)
    tables = tables_for(lengths, 16, seed=22)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(23)).to(DEVICE, q_dtype)
    scale = 0.005  # scores of the largest head's keys about 1, so that the loose comparison is well conditioned
    out = kernels.paged_decode_attention(q, cache, as_tensor(tables), torch.tensor(lengths, device=DEVICE), scale,
                                         window, num_splits=splits, block_n=16, kv_scale=scales)
    assert out.dtype == q_dtype
    tight = 1e-5 if q_dtype == torch.float32 else 2e-2
    for i, length in enumerate(lengths):
        position = torch.tensor([length - 1], device=DEVICE)
        k, v = gather(dequantize(cache, scales), tables[i], length)
        want = reference(q[i:i + 1], k, v, position, scale, window)
        torch.testing.assert_close(out[i:i + 1].float(), want, rtol=tight, atol=tight * want.abs().max().item())
        k, v = gather(values, tables[i], length)
        exact = reference(q[i:i + 1], k, v, position, scale, window)
        torch.testing.assert_close(out[i:i + 1].float(), exact, rtol=0.1, atol=0.1 * exact.abs().max().item())


@pytest.mark.parametrize("q_dtype, splits", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 2),
                                             (torch.bfloat16, 1)])
def test_paged_prefill_attention_over_fp8(q_dtype: torch.dtype, splits: int) -> None:
    """A whole prompt, a chunk after a cached context and a decode row, over a float8 cache
    (``splits`` > 0: the decode row through the decode kernel, as a prompt step's)."""
    heads, kv_heads, head_dim = 4, 2, 16
    query_lens, seq_lens = [18, 5, 1], [18, 14, 11]
    scales = torch.tensor([[2.0, 0.125], [1.0, 0.7]], device=DEVICE)
    values, cache = fp8_cache(20, kv_heads, head_dim, scales, seed=24)
    tables = tables_for(seq_lens, 20, seed=25)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(26)).to(DEVICE, q_dtype)
    starts = torch.tensor([0, 18, 23, 24], dtype=torch.int32, device=DEVICE)
    scale = 0.01
    out = prompt_step_attention(q, cache, as_tensor(tables), starts, torch.tensor(seq_lens, device=DEVICE),
                                max(query_lens), scale, splits=splits, kv_scale=scales)
    tight = 1e-5 if q_dtype == torch.float32 else 2e-2
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        k, v = gather(dequantize(cache, scales), tables[i], seq_len)
        want = reference(q[rows], k, v, positions, scale, None)
        torch.testing.assert_close(out[rows].float(), want, rtol=tight, atol=tight * want.abs().max().item())
        k, v = gather(values, tables[i], seq_len)
        exact = reference(q[rows], k, v, positions, scale, None)
        torch.testing.assert_close(out[rows].float(), exact, rtol=0.1, atol=0.1 * exact.abs().max().item())


def test_a_float8_cache_needs_its_scales() -> None:
    cache = torch.zeros(2, 2, BLOCK, 1, 16, dtype=FP8, device=DEVICE)
    q = torch.zeros(1, 1, 16, device=DEVICE)
    args = (q, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32,
                                                                                           device=DEVICE), 1.0)
    with pytest.raises(AssertionError, match="scales"):
        kernels.paged_decode_attention(*args)
    with pytest.raises(AssertionError, match="scales"):
        kernels.paged_decode_attention(q, cache.float(), *args[2:], kv_scale=torch.ones(2, 1, device=DEVICE))


def test_power_of_two_scales_place_the_maximum_in_16_to_32() -> None:
    amax = torch.tensor([[0.0, 0.01, 16.0, 16.5], [31.9, 32.0, 32.5, 3000.0]])
    scales = kv_fp8.power_of_two_scales(amax)
    assert scales[0, 0] == 1  # a head of zeros
    assert torch.equal(torch.log2(scales), torch.log2(scales).round())
    placed = amax[amax > 0] / scales[amax > 0]
    assert ((placed > 16) & (placed <= 32)).all(), placed


def test_checkpoint_kv_scales(tmp_path) -> None:
    assert kv_fp8.checkpoint_kv_scales(tmp_path, 2, 2) is None  # a directory without weights
    assert kv_fp8.checkpoint_kv_scales(tmp_path / "model.gguf", 2, 2) is None
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.k_scale": torch.tensor([1.5, 3.0]),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="layer 1 lacks self_attn.v_scale"):
        kv_fp8.checkpoint_kv_scales(tmp_path, 2, 2)
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(2.0)}, tmp_path / "b.safetensors")
    scales = kv_fp8.checkpoint_kv_scales(tmp_path, 2, 2)
    assert [s.tolist() for s in scales] == [[[0.5, 0.5], [0.25, 0.25]], [[1.5, 3.0], [2.0, 2.0]]]
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(-2.0)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match="positive and finite"):
        kv_fp8.checkpoint_kv_scales(tmp_path, 2, 2)


def test_greedy_tokens_with_a_float8_cache_equal_float32s(tiny_model_dir) -> None:
    path = str(tiny_model_dir)
    config = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=5, max_model_len=64, device="cpu")
    prompts = [[5, 90, 31, 242, 77, 12, 5, 90, 31, 242, 77, 12, 5, 90], [8, 100, 200, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    full = [o.outputs[0] for o in with_cuda_runner(LLM(path, **config), path).generate(prompts, params)]
    llm = with_cuda_runner(LLM(path, **config), path, FP8)
    runner = llm.engine.runner
    assert runner.kv_caches[0].dtype == FP8 and len(runner.kv_scales) == len(runner.kv_caches)
    fp8 = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in fp8] == [o.token_ids for o in full]
    for a, b in zip(fp8, full):  # about -8 each; float8 moves them by up to 0.05 here
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 0.1
    # The calibrated scales (1/8 and 1/16 here) store these prompts' K/V near 32; 1.0 would leave them under 4.
    stored = [cache.float().abs().amax().item() for cache in runner.kv_caches]
    assert all(8 < amax <= 64 for amax in stored), stored
    runner.clear_blocks(list(range(32)))
    assert not any(cache.view(torch.uint8).any() for cache in runner.kv_caches)
    llm.engine.check_integrity()
    # Calibration is a function of the weights alone.
    again = with_cuda_runner(LLM(path, **config), path, FP8).engine.runner
    assert all(torch.equal(a, b) for a, b in zip(again.kv_scales, runner.kv_scales))


def test_a_checkpoints_kv_scales_are_used(make_tiny_llama) -> None:
    path = make_tiny_llama()
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.5 + i + (kind == "v"))
              for i in range(2) for kind in "kv"}
    save_file(scales, path / "kv_scales.safetensors")
    llm = with_cuda_runner(LLM(str(path), num_kv_blocks=8, block_size=4, max_model_len=32, device="cpu"), str(path),
                           FP8)
    got = llm.engine.runner.kv_scales
    assert [s.tolist() for s in got] == [[[0.5, 0.5], [1.5, 1.5]], [[1.5, 1.5], [2.5, 2.5]]]
