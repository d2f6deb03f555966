"""``torch.ops.vivace.paged_decode_attention`` (native when it built) against the PyTorch reference."""

import pytest
import torch

from vivace.layers import decode_attention, native, prefill_attention
from vivace.layers.decode_attention import reference_decode_attention

OP = torch.ops.vivace.paged_decode_attention


def random_batch(dtype: torch.dtype, num_seqs: int, heads: int = 6, kv_heads: int = 2, head_dim: int = 32,
                 block_size: int = 4, num_blocks: int = 40, seed: int = 0, width: int = 8):
    """Sequences of random lengths over shuffled blocks; block tables padded wider than needed."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.randint(1, (width - 2) * block_size, (num_seqs,), generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * width].view(num_seqs, width)
    slots = tables[torch.arange(num_seqs), (seq_lens - 1) // block_size] * block_size + (seq_lens - 1) % block_size
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_seqs, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, cache, slots, tables, seq_lens


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_seqs", [1, 5])
def test_op_matches_reference_and_writes_the_same_cache(dtype, tol, num_seqs):
    q, k, v, cache, slots, tables, seq_lens = random_batch(dtype, num_seqs)
    ref_cache = cache.clone()
    out = OP(q, k, v, cache, slots, tables, seq_lens, 0.3)
    expected = reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, 0.3)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("block_size, head_dim, width", [(16, 64, 24), (32, 128, 8), (16, 16, 12), (8, 80, 40)])
def test_op_matches_reference_on_long_sequences(block_size, head_dim, width):
    """Lengths spanning whole 16-token runs and tails, for several head sizes."""
    q, k, v, cache, slots, tables, seq_lens = random_batch(
        torch.float32, 7, heads=9, kv_heads=3, head_dim=head_dim, block_size=block_size,
        num_blocks=7 * width, seed=block_size + head_dim, width=width)
    ref_cache = cache.clone()
    out = OP(q, k, v, cache, slots, tables, seq_lens, head_dim ** -0.5)
    expected = reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 1, 32), (4, 2, 128), (4, 1, 256)])
def test_float32_queries_over_a_half_precision_cache(cache_dtype, heads, kv_heads, head_dim):
    """The KV cache narrower than the model (--kv-cache-dtype): new rows stored rounded, attention
    in float32 over the stored values; groups that take one pass and several."""
    q, k, v, cache, slots, tables, seq_lens = random_batch(
        torch.float32, 5, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, num_blocks=5 * 6,
        seed=heads + head_dim, width=6)
    cache = cache.to(cache_dtype)
    ref_cache = cache.clone()
    out = OP(q, k, v, cache, slots, tables, seq_lens, head_dim ** -0.5)
    expected = reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, head_dim ** -0.5)
    assert out.dtype == torch.float32
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("run", [1, 3, 4, 16, 33])
def test_rows_of_one_sequence_match_row_by_row_attention(cache_dtype, run):
    """A prompt chunk riding the decode step: ``run`` rows at consecutive positions of one sequence
    (same block table), between other sequences; runs of 16 or more rows take the prefill kernel,
    shorter ones the decode kernel, several rows per pass."""
    q, k, v, cache, slots, tables, seq_lens = random_batch(torch.float32, 3 + run, heads=9, kv_heads=3, head_dim=64,
                                                           block_size=16, num_blocks=(3 + run) * 12, seed=run,
                                                           width=12)
    cache = cache.to(cache_dtype)
    end = 140 + run  # the chunk's rows: positions end - run .. end - 1 of one sequence, rows 1 .. run
    tables[1:1 + run] = tables[1]
    seq_lens[1:1 + run] = torch.arange(end - run + 1, end + 1)
    rows = torch.arange(len(q))
    slots = tables[rows, (seq_lens - 1) // 16] * 16 + (seq_lens - 1) % 16
    ref_cache = cache.clone()
    out = OP(q, k, v, cache, slots, tables, seq_lens, 0.125)
    expected = reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, 0.125)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_op_accepts_rows_sliced_from_a_fused_projection():
    q, k, v, cache, slots, tables, seq_lens = random_batch(torch.float32, 3)
    fused = torch.cat([q, k, v], dim=1)  # [seqs, heads + 2 kv_heads, d], as the model splits it
    parts = fused.split([q.shape[1], k.shape[1], v.shape[1]], dim=1)
    ref_cache = cache.clone()
    out = OP(*parts, cache, slots, tables, seq_lens, 0.3)
    torch.testing.assert_close(out, reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, 0.3))


@pytest.mark.skipif(decode_attention.BACKEND != "native", reason="the native kernel did not build here")
def test_native_op_rejects_blocks_outside_the_cache():
    q, k, v, cache, slots, tables, seq_lens = random_batch(torch.float32, 2)
    tables[1, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        OP(q, k, v, cache, slots, tables, seq_lens, 0.3)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 1000])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_windowed_op_matches_reference(window, dtype, tol):
    """Windows inside one block, across blocks, on 16-token runs, and longer than every sequence."""
    q, k, v, cache, slots, tables, seq_lens = random_batch(dtype, 7, block_size=8, head_dim=64, num_blocks=7 * 12,
                                                           seed=window, width=12)
    ref_cache = cache.clone()
    out = OP(q, k, v, cache, slots, tables, seq_lens, 0.2, window)
    expected = reference_decode_attention(q, k, v, ref_cache, slots, tables, seq_lens, 0.2, window)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    if window == 1:  # a query that sees only itself returns its own value
        torch.testing.assert_close(out.float(), v.repeat_interleave(3, dim=1).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("first_len, run", [(12, 5), (14, 5), (29, 15), (16, 3), (40, 2)])
def test_a_verify_steps_rows_equal_one_row_steps_bit_for_bit(cache_dtype, first_len, run):
    """A verify step (``run`` consecutive rows of one sequence, proposals after its next token)
    computes each row's attention exactly as the one-row step at that length would, also where the
    run crosses into a new block (the last block then holds more tokens than a shorter row sees):
    greedy speculative decoding depends on it."""
    q, k, v, cache, _, tables, _ = random_batch(torch.float32, run, heads=9, kv_heads=3, head_dim=64,
                                                block_size=16, num_blocks=run * 6, seed=first_len + run, width=6)
    cache = cache.to(cache_dtype)
    tables[:] = tables[0]
    seq_lens = torch.arange(first_len, first_len + run)
    slots = tables[0, (seq_lens - 1) // 16] * 16 + (seq_lens - 1) % 16
    together = OP(q, k, v, cache.clone(), slots, tables, seq_lens, 0.125)
    one_cache = cache.clone()
    for row in range(run):  # as one-row steps, each writing its K/V before the next attends
        alone = OP(q[row:row + 1], k[row:row + 1], v[row:row + 1], one_cache, slots[row:row + 1], tables[:1],
                   seq_lens[row:row + 1], 0.125)
        assert torch.equal(alone[0], together[row]), f"row {row} (length {first_len + row})"


@pytest.mark.skipif(decode_attention.BACKEND != "native" or prefill_attention.BACKEND != "native",
                    reason="the native kernels did not build here")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("run, prompt, window", [(1, 1, 0), (3, 3, 0), (5, 2, 0), (20, 20, 0), (20, 0, 0), (18, 4, 0),
                                                 (20, 20, 40), (6, 6, 20), (20, 15, 1000)])
def test_flagged_prompt_rows_get_the_prefill_kernels_bits(cache_dtype, run, prompt, window):
    """Rows flagged ``prompt_rows`` (a prompt chunk riding a compiled step) get the prefill kernel's
    result for that chunk bit for bit (what a step on the prefill path gives them) at any run
    length, where a ``window`` hides none of their keys; the run's other rows (generated tokens,
    prompt rows past the window) what one-row steps give, at any run length too."""
    q, k, v, cache, _, tables, _ = random_batch(torch.float32, run, heads=9, kv_heads=3, head_dim=64,
                                                block_size=16, num_blocks=run * 6, seed=run + prompt, width=6)
    cache = cache.to(cache_dtype)
    tables[:] = tables[0]
    seq_lens = torch.arange(30, 30 + run)
    slots = tables[0, (seq_lens - 1) // 16] * 16 + (seq_lens - 1) % 16
    flags = torch.tensor([1] * prompt + [0] * (run - prompt))
    together = OP(q, k, v, cache, slots, tables, seq_lens, 0.125, window, flags)  # writes every row's K/V
    whole = prompt if window == 0 else int((seq_lens[:prompt] <= window).sum())
    if whole:
        chunk = torch.ops.vivace.paged_prefill_attention(q[:whole], cache, tables[0], int(seq_lens[whole - 1]), 0.125)
        assert torch.equal(together[:whole], chunk)
    for row in range(whole, run):
        alone = OP(q[row:row + 1], k[row:row + 1], v[row:row + 1], cache.clone(), slots[row:row + 1], tables[:1],
                   seq_lens[row:row + 1], 0.125, window)
        assert torch.equal(alone[0], together[row]), f"row {row}"


def decode_rows_and_prefill(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, group: int,
                            block_size: int, seq_len: int, q_len: int, seed: int):
    """The last ``q_len`` positions of one ``seq_len``-token sequence attended three ways: by the
    prefill kernel as a chunk, by the decode kernel as one pass of rows, and row by row."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, num_blocks = 2, -(-seq_len // block_size) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    table = torch.randperm(num_blocks, generator=gen)
    q = torch.randn(q_len, kv_heads * group, head_dim, generator=gen).to(q_dtype)
    scale = head_dim ** -0.5
    chunk = torch.ops.vivace.paged_prefill_attention(q, cache, table, seq_len, scale)
    lens = torch.arange(seq_len - q_len + 1, seq_len + 1)
    slots = table[(lens - 1) // block_size] * block_size + (lens - 1) % block_size
    k, v = (cache[i].flatten(0, 1)[slots].to(q_dtype) for i in range(2))  # stored again unchanged
    tables = table.expand(q_len, -1).contiguous()
    together = OP(q, k, v, cache, slots, tables, lens, scale, 0, torch.zeros(q_len, dtype=torch.long))
    alone = [OP(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, slots[i:i + 1], tables[:1], lens[i:i + 1], scale)[0]
             for i in range(q_len)]
    return chunk, together, torch.stack(alone)


@pytest.mark.skipif(decode_attention.BACKEND != "native" or prefill_attention.BACKEND != "native",
                    reason="the native kernels did not build here")
@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                  (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16)])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 256])
def test_decode_rows_equal_the_prefill_kernels_bits(q_dtype, cache_dtype, head_dim):
    """A row the decode kernel attends (alone, or in a pass with other rows of its sequence) gets the
    prefill kernel's bits for the same row: one arithmetic in both (attention_math.h), so a position's
    hidden state, hence the K/V above it, does not depend on which kernel attended it (a prefix-cache
    hit on an earlier answer against a miss). Groups 1 to 8; lengths across 16-key runs, 64-key
    chunks and block boundaries, block sizes that divide 64 and ones that do not."""
    if not native.cpu_has(native.AVX512_CPU_FLAGS):
        pytest.skip("the AVX2 twins keep their own orders: there the kernels agree to tolerance only")
    cases = [(16, 1, 1), (16, 17, 5), (8, 64, 4), (4, 65, 7), (24, 130, 9), (32, 300, 12), (64, 129, 3), (48, 200, 2)]
    for group in range(1, 9):
        for block_size, seq_len, q_len in cases:
            chunk, together, alone = decode_rows_and_prefill(q_dtype, cache_dtype, head_dim, group, block_size,
                                                             seq_len, q_len, seed=group * 1000 + seq_len)
            where = f"group {group}, block size {block_size}, rows {seq_len - q_len + 1}..{seq_len}"
            assert torch.equal(together, chunk), where
            assert torch.equal(alone, chunk), where
