"""``torch.ops.vivace.paged_prefill_attention`` (native when it built) against SDPA over the gathered K/V."""

import pytest
import torch
import torch.nn.functional as F

from vivace.layers import attention, prefill_attention
from vivace.layers.prefill_attention import reference_prefill_attention

OP = torch.ops.vivace.paged_prefill_attention


def random_case(dtype: torch.dtype, seq_len: int, q_len: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                block_size: int = 16, spare_blocks: int = 3, seed: int = 0):
    """A cache with more blocks than the sequence needs, its blocks in shuffled order, a longer table."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size) + spare_blocks
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype)
    return q, cache, table


def sdpa(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Float64 SDPA over K/V gathered slot by slot, with an explicit causal mask."""
    block_size = cache.shape[2]
    slots = torch.arange(seq_len)
    keys = cache[0, table[slots // block_size], slots % block_size].double()  # [seq_len, kv_heads, d]
    values = cache[1, table[slots // block_size], slots % block_size].double()
    q_len = q.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("seq_len", [1, 15, 17, 64, 65, 100, 513])
@pytest.mark.parametrize("chunk", ["whole", "tail"])
def test_float32_matches_sdpa(seq_len, chunk):
    q_len = seq_len if chunk == "whole" else max(1, seq_len // 3)
    q, cache, table = random_case(torch.float32, seq_len, q_len, seed=seq_len)
    out = OP(q, cache, table, seq_len, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, sdpa(q, cache, table, seq_len, 0.125).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, reference_prefill_attention(q, cache, table, seq_len, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("seq_len, q_len", [(100, 100), (130, 3), (200, 71)])
def test_head_dims_and_block_sizes(head_dim, block_size, seq_len, q_len):
    q, cache, table = random_case(torch.float32, seq_len, q_len, head_dim=head_dim, block_size=block_size,
                                  seed=head_dim + block_size)
    scale = head_dim ** -0.5
    torch.testing.assert_close(OP(q, cache, table, seq_len, scale), sdpa(q, cache, table, seq_len, scale).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 1), (6, 2), (15, 3)])
def test_group_sizes(heads, kv_heads):
    q, cache, table = random_case(torch.float32, 150, 150, heads=heads, kv_heads=kv_heads, seed=heads)
    torch.testing.assert_close(OP(q, cache, table, 150, 0.125), sdpa(q, cache, table, 150, 0.125).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("seq_len, q_len", [(17, 17), (513, 513), (300, 40)])
def test_half_precision(dtype, tol, seq_len, q_len):
    q, cache, table = random_case(dtype, seq_len, q_len, seed=seq_len + q_len)
    out = OP(q, cache, table, seq_len, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), sdpa(q, cache, table, seq_len, 0.125).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seq_len, q_len", [(17, 17), (300, 40), (513, 5)])
def test_float32_queries_over_a_half_precision_cache(cache_dtype, seq_len, q_len):
    """The KV cache narrower than the model (--kv-cache-dtype): float32 attention over its values,
    from the native kernel (as the decode kernel attends them)."""
    q, cache, table = random_case(torch.float32, seq_len, q_len, seed=seq_len + q_len)
    cache = cache.to(cache_dtype)
    native = prefill_attention.native_supports(q, cache)
    assert native == prefill_attention.USE_NATIVE
    out = attention._prefill_attention(q, cache, table, seq_len, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa(q, cache, table, seq_len, 0.125).float(), rtol=1e-5, atol=1e-5)


def test_peaked_scores_stay_finite_and_exact():
    """Large logits: the running max must rescale earlier chunks (no overflow, no lost mass)."""
    q, cache, table = random_case(torch.float32, 300, 300, seed=7)
    q, cache = q * 8, cache * 4
    out = OP(q, cache, table, 300, 0.125)
    assert torch.isfinite(out).all()
    # Logits of some +-100 carry float32 rounding of ~1e-5 in any kernel: as close as PyTorch's own.
    exact = sdpa(q, cache, table, 300, 0.125)
    ours = (out.double() - exact).abs().max()
    torch_error = (reference_prefill_attention(q, cache, table, 300, 0.125).double() - exact).abs().max()
    assert ours <= 1.5 * torch_error + 1e-6


def test_query_rows_sliced_from_a_fused_projection():
    q, cache, table = random_case(torch.float32, 40, 40)
    fused = torch.cat([q, torch.randn(40, 6, 64)], dim=1)  # [tokens, heads + 2 kv_heads, d]
    sliced = fused.split([9, 6], dim=1)[0]
    torch.testing.assert_close(OP(sliced, cache, table, 40, 0.125), OP(q, cache, table, 40, 0.125))


def test_prefill_attention_hook_uses_the_op_and_matches_the_sdpa_path(monkeypatch):
    q, cache, table = random_case(torch.float32, 200, 50)
    ours = attention._prefill_attention(q, cache, table, 200, 0.125)
    monkeypatch.setattr(prefill_attention, "USE_NATIVE", False)
    theirs = attention._prefill_attention(q, cache, table, 200, 0.125)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_fake_kernel_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(12, 9, 64)
        out = OP(q, torch.empty(2, 4, 16, 3, 64), torch.zeros(4, dtype=torch.long), 40, 0.125)
    assert out.shape == (12, 9, 64) and out.dtype == torch.float32


@pytest.mark.skipif(prefill_attention.BACKEND != "native", reason="the native kernel did not build here")
def test_native_op_rejects_bad_tables():
    q, cache, table = random_case(torch.float32, 40, 40)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OP(q, cache, torch.full_like(table, cache.shape[1]), 40, 0.125)
    with pytest.raises(RuntimeError, match="does not fit"):
        OP(q, cache, table[:1], 40, 0.125)
    with pytest.raises(RuntimeError, match="q_len"):
        OP(q, cache, table, 39, 0.125)


@pytest.mark.parametrize("seq_len, q_len", [(513, 513), (300, 16), (1000, 5)])
def test_thread_count_does_not_change_the_result(seq_len, q_len):
    """Work is split differently per thread count; every row's arithmetic stays the same."""
    q, cache, table = random_case(torch.float32, seq_len, q_len, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OP(q, cache, table, seq_len, 0.125)
        torch.set_num_threads(2)
        two = OP(q, cache, table, seq_len, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
