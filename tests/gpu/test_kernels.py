"""Each Triton kernel against a float32 torch reference at tiny shapes (the interpreter is slow on
CPU): paged decode attention (GQA packed, split-K, window, mixed dtypes), paged prefill attention
(chunks after a cached context, causal, window, a mixed batch, its decode rows through the decode
kernel), rotary + KV write (with per-head
q/k norms), add + RMSNorm, SiLU * mul, GELU-tanh * mul; and the attention launch's shape rules."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA backend's kernels need triton (pip install triton)")

from vivace.gpu import kernels  # noqa: E402
from vivace.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

from .conftest import DEVICE  # noqa: E402

BLOCK = 4  # tokens per KV block: sequences span several blocks, out of order


def random_cache(num_blocks: int, kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(DEVICE)


def gather(cache: torch.Tensor, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, kv_heads, head_dim]`` of a sequence, in position order."""
    k = cache[0, table].flatten(0, 1)[:length]
    v = cache[1, table].flatten(0, 1)[:length]
    return k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
              window: int | None) -> torch.Tensor:
    """Queries ``[n, heads, d]`` at ``positions`` over keys 0..len-1, causal (and windowed), float32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    key = torch.arange(k.shape[0], device=q.device)
    visible = key[None, :] <= positions[:, None]
    if window is not None:
        visible &= key[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def tables_for(lengths: list[int], num_blocks: int, seed: int = 1) -> list[list[int]]:
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for length in lengths:
        need = -(-length // BLOCK)
        tables.append(perm[used:used + need])
        used += need
    return tables


def as_tensor(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("splits, window", [(1, None), (4, None), (3, 5)])
def test_paged_decode_attention(splits: int, window: int | None) -> None:
    heads, kv_heads, head_dim, lengths = 6, 2, 16, [1, 7, 19]
    cache = random_cache(16, kv_heads, head_dim)
    tables = tables_for(lengths, 16)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, cache, as_tensor(tables), torch.tensor(lengths, device=DEVICE), scale,
                                         window, num_splits=splits, block_n=16)
    for i, length in enumerate(lengths):
        k, v = gather(cache, tables[i], length)
        want = reference(q[i:i + 1], k, v, torch.tensor([length - 1], device=DEVICE), scale, window)
        torch.testing.assert_close(out[i:i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype, kv_dtype, head_dim", [(torch.bfloat16, torch.bfloat16, 32),
                                                         (torch.float32, torch.bfloat16, 24),
                                                         (torch.bfloat16, torch.float16, 32)])
def test_paged_decode_attention_16_bit_within_tolerance(q_dtype: torch.dtype, kv_dtype: torch.dtype,
                                                        head_dim: int) -> None:
    """bfloat16 throughout, and queries of another dtype than the cache (``tl.dot`` on a GPU
    takes one dtype: the kernel multiplies those in float32), at a head_dim that is no power of two."""
    heads, kv_heads, lengths = 4, 4, [9, 33]
    cache = random_cache(24, kv_heads, head_dim).to(kv_dtype)
    tables = tables_for(lengths, 24)
    q = torch.randn(2, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE, q_dtype)
    out = kernels.paged_decode_attention(q, cache, as_tensor(tables), torch.tensor(lengths, device=DEVICE),
                                         0.2, num_splits=2, block_n=16)
    assert out.dtype == q_dtype
    for i, length in enumerate(lengths):
        k, v = gather(cache, tables[i], length)
        want = reference(q[i:i + 1], k, v, torch.tensor([length - 1], device=DEVICE), 0.2, None)
        torch.testing.assert_close(out[i:i + 1].float(), want, rtol=2e-2, atol=2e-2)


def prompt_step_attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                          seq_lens: torch.Tensor, max_query_len: int, scale: float, window: int | None = None,
                          splits: int = 0, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt step's attention as the forward launches it: the prefill kernel alone (``splits``
    0), or it for the chunks and the decode kernel with ``splits`` for the decode rows."""
    out = kernels.paged_prefill_attention(q, cache, tables, starts, seq_lens, max_query_len, scale, window,
                                          block_m=16, block_n=16, kv_scale=kv_scale, decodes_apart=splits > 0)
    if splits:
        kernels.paged_decode_attention(q, cache, tables, seq_lens, scale, window, splits, out, block_n=16,
                                       kv_scale=kv_scale, query_start=starts)
    return out


@pytest.mark.parametrize("window, splits", [(None, 0), (6, 0), (None, 1), (6, 3)])
def test_paged_prefill_attention_mixed_batch(window: int | None, splits: int) -> None:
    """Three sequences: a whole prompt, a chunk after a cached context (a prefix-cache hit or a
    later chunk), and a decode row (``splits`` > 0: through the decode kernel)."""
    heads, kv_heads, head_dim = 4, 2, 16
    # The prompt spans two blocks of 16 queries; the others' second blocks are empty.
    query_lens, seq_lens = [18, 5, 1], [18, 14, 11]
    cache = random_cache(20, kv_heads, head_dim, seed=4)
    tables = tables_for(seq_lens, 20, seed=5)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    starts = torch.tensor([0, 18, 23, 24], dtype=torch.int32, device=DEVICE)
    scale = 0.3
    out = prompt_step_attention(q, cache, as_tensor(tables), starts, torch.tensor(seq_lens, device=DEVICE),
                                max(query_lens), scale, window, splits)
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        k, v = gather(cache, tables[i], seq_len)
        rows = slice(int(starts[i]), int(starts[i + 1]))
        positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        torch.testing.assert_close(out[rows], reference(q[rows], k, v, positions, scale, window), rtol=1e-5, atol=1e-5)


def test_paged_prefill_attention_finds_each_chunk_in_a_flat_grid() -> None:
    """The grid is the batch's query blocks, flat: chunks that start off a block boundary, straddle
    one or fill it exactly, decode rows between them, and sequences with no queries (a CUDA graph's
    unused slots) each find their own queries, and nothing else is written."""
    heads, kv_heads, head_dim, block_m = 2, 1, 16, 16
    query_lens = [1, 17, 0, 16, 3, 33, 1, 0, 0]
    seq_lens = [9, 17, 0, 20, 3, 40, 6, 0, 0]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    tokens = starts[-1] + 5  # rows past the last chunk: the graph's padding, which no sequence owns
    cache = random_cache(40, kv_heads, head_dim, seed=7)
    tables = tables_for([max(length, 1) for length in seq_lens], 40, seed=8)
    q = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = torch.full_like(q, 7.0)
    kernels.paged_prefill_attention(q, cache, as_tensor(tables), torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                                    torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), max(query_lens), 0.25,
                                    out=out, block_m=block_m, block_n=16)
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len:
            k, v = gather(cache, tables[i], seq_len)
            rows = slice(starts[i], starts[i + 1])
            positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
            torch.testing.assert_close(out[rows], reference(q[rows], k, v, positions, 0.25, None), rtol=1e-5, atol=1e-5)
    assert (out[starts[-1]:] == 7.0).all()


@pytest.mark.parametrize("splits, window", [(1, None), (4, None), (3, 5)])
def test_decode_rows_of_a_prompt_step_take_the_decode_kernel(splits: int, window: int | None) -> None:
    """A prompt step's sequences of one query (decode rows, one at position 0) between a whole
    prompt, a chunk after a cached context and sequences with no queries, a graph's padding rows
    past them all: the prefill kernel with ``decodes_apart`` leaves the decode rows unwritten, the
    decode kernel with ``query_start`` writes them (GQA-packed, split-K) and nothing else, and the
    two give the reference, as the prefill kernel alone does."""
    heads, kv_heads, head_dim = 4, 2, 16
    query_lens = [1, 18, 1, 0, 5, 1, 1, 0]
    seq_lens = [9, 18, 30, 0, 14, 1, 7, 0]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    tokens = starts[-1] + 3
    cache = random_cache(40, kv_heads, head_dim, seed=10)
    tables = as_tensor(tables_for([max(length, 1) for length in seq_lens], 40, seed=11))
    q = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    starts_t = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    kernels.paged_prefill_attention(q, cache, tables, starts_t, lens_t, max(query_lens), 0.25, window, out=out,
                                    block_m=16, block_n=16, decodes_apart=True)
    decode_rows = torch.zeros(tokens, dtype=torch.bool, device=DEVICE)
    decode_rows[[start for start, q_len in zip(starts, query_lens) if q_len == 1]] = True
    assert (out[decode_rows] == 7.0).all()
    prefilled = out.clone()
    kernels.paged_decode_attention(q, cache, tables, lens_t, 0.25, window, splits, out, block_n=16,
                                   query_start=starts_t)
    assert torch.equal(out[~decode_rows], prefilled[~decode_rows])
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len:
            k, v = gather(cache, tables[i].tolist(), seq_len)
            rows = slice(starts[i], starts[i + 1])
            positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
            torch.testing.assert_close(out[rows], reference(q[rows], k, v, positions, 0.25, window), rtol=1e-5,
                                       atol=1e-5)
    alone = kernels.paged_prefill_attention(q, cache, tables, starts_t, lens_t, max(query_lens), 0.25, window,
                                            block_m=16, block_n=16)
    torch.testing.assert_close(out[:starts[-1]], alone[:starts[-1]], rtol=1e-5, atol=1e-5)
    assert (out[starts[-1]:] == 7.0).all()


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` ``[tokens, heads, head_dim]`` (the identity without ``weight``)."""
    if weight is None:
        return x
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kv_write(qk_norm: bool) -> None:
    heads, kv_heads, head_dim, tokens, eps = 4, 2, 16, 5, 1e-6
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, torch.float32)
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    q_norm, k_norm = (torch.randn(head_dim, generator=g).to(DEVICE) if qk_norm else None for _ in range(2))
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    slots = torch.tensor([5, 0, 31, 12, 7], device=DEVICE)
    cache = torch.zeros(2, 8, BLOCK, kv_heads, head_dim, device=DEVICE)
    q = kernels.rotary_kv_write(qkv, cos, sin, positions, slots, cache, heads, q_norm=q_norm, k_norm=k_norm, eps=eps)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_want = apply_rotary(head_rms_norm(q_ref.reshape(tokens, heads, head_dim), q_norm, eps), c, s)
    torch.testing.assert_close(q, q_want)
    flat = cache.view(2, -1, kv_heads, head_dim)
    k_want = apply_rotary(head_rms_norm(k_ref.reshape(tokens, kv_heads, head_dim), k_norm, eps), c, s)
    torch.testing.assert_close(flat[0, slots], k_want)
    torch.testing.assert_close(flat[1, slots], v_ref.reshape(tokens, kv_heads, head_dim))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not flat[:, untouched.to(DEVICE)].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_as_hugging_face_rounds_it(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(8)
    x, residual = (torch.randn(3, 48, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(48, generator=g).to(DEVICE, dtype)
    want_sum = residual + x
    want = weight * (want_sum.float() * torch.rsqrt(want_sum.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out, summed = kernels.rms_norm(x, weight, 1e-6, residual.clone())
    # Exact on the GPU; the interpreter rounds float32 to bfloat16 by its own rule (1 ulp apart).
    ulp = 0 if DEVICE == "cuda" or dtype == torch.float32 else 8e-3
    torch.testing.assert_close(summed, want_sum, rtol=ulp, atol=0)
    torch.testing.assert_close(out, want, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)
    plain = kernels.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(plain.float(), (weight * (x.float() * torch.rsqrt(
        x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)).float(), rtol=2e-2, atol=1e-5)
    gemma = kernels.rms_norm(x, weight, 1e-6, unit_offset=True)
    x32 = x.float()
    want_gemma = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())).to(dtype)
    torch.testing.assert_close(gemma, want_gemma, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_silu_mul() -> None:
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(kernels.silu_mul(x, block=16), torch.nn.functional.silu(gate) * up)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, at the far tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(dtype: torch.dtype) -> None:
    x = (4 * torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(11))).to(DEVICE, dtype)
    gate, up = x.chunk(2, -1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kernels.gelu_tanh_mul(x, block=16), want, **tolerance)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_attention_launch_fits_an_h100(head_dim: int, itemsize: int) -> None:
    """What the interpreter cannot check: tiles ``tl.dot`` takes on a GPU, pipelined K/V tiles
    within shared memory, float32 accumulators within registers."""
    block_d = kernels._pow2(head_dim, 16)
    for rows in (16, 64):  # a decode's padded query heads, a prefill's queries
        launch = kernels.attention_launch(rows, block_d, 64, itemsize)
        assert launch["num_stages"] * 2 * 64 * block_d * itemsize <= kernels.KV_TILES_SMEM
        assert launch["num_warps"] in (4, 8) and rows * block_d / (32 * launch["num_warps"]) <= 64
    for bad in ((3, block_d, 64), (16, head_dim + 1, 64), (16, block_d, 8)):  # SmolLM2's 3 heads unpadded, ...
        with pytest.raises(AssertionError):
            kernels.attention_launch(*bad, itemsize)


def test_decode_splits_fill_the_gpu_but_keep_a_block_of_keys_each() -> None:
    assert kernels.decode_splits(512, 1, 8) == 8  # 33 programs wanted per... capped by 512 // 64
    assert kernels.decode_splits(32, 1, 8) == 1
    assert kernels.decode_splits(4096, 64, 8) == 1
    assert math.log2(kernels.decode_splits(100000, 1, 1)).is_integer()


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_gemv(splits) -> None:
    """One row, K split among ``splits`` programs (3: splits of uneven length)."""
    g = torch.Generator().manual_seed(10)
    weight, x = torch.randn(19, 70, generator=g).to(DEVICE), torch.randn(70, generator=g).to(DEVICE)
    torch.testing.assert_close(kernels.gemv(weight, x, block_n=4, block_k=16, splits=splits), weight @ x,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [None, "silu", "gelu"])
def test_gemv_with_bias_and_the_mlp_activation_taken_as_it_loads(dtype, gated, splits) -> None:
    """One row ``[1, K]`` (or an MLP's ``[1, 2K]``), a bias: as ``F.linear`` after ``silu_mul`` /
    ``gelu_tanh_mul``, whose rounding the fused activation repeats."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(37, 80, generator=g).to(DEVICE, dtype)
    bias = torch.randn(37, generator=g).to(DEVICE, dtype)
    x = torch.randn(1, 160 if gated else 80, generator=g).to(DEVICE, dtype)
    y = x if gated is None else kernels.silu_mul(x) if gated == "silu" else kernels.gelu_tanh_mul(x)
    want = (y.float() @ weight.float().T + bias.float()).to(dtype)
    got = kernels.gemv(weight, x, bias, gated, block_n=8, block_k=32, splits=splits)
    assert got.shape == (1, 37)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_folds_the_norm_before_it_and_the_residual_add_after_it(dtype, splits) -> None:
    """A batch-1 decoder step through the GEMV alone: ``h = rms_norm(residual)`` taken as the GEMV
    loads ``residual``, and ``residual + linear(h)`` written into ``residual`` by the GEMV (or its
    split sum) — as the norm kernel and the unfused product round them, bit for bit up to the
    norm's summation order."""
    g = torch.Generator().manual_seed(12)
    hidden, inner = 96, 40
    residual = torch.randn(1, hidden, generator=g).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    up, down = (torch.randn(inner, hidden, generator=g).to(DEVICE, dtype),
                torch.randn(hidden, inner, generator=g).to(DEVICE, dtype))
    bias = torch.randn(hidden, generator=g).to(DEVICE, dtype)

    h = kernels.rms_norm(residual, norm_weight, 1e-6)
    want_inner = kernels.gemv(up, h, block_n=8, block_k=32, splits=splits)
    got_inner = kernels.gemv(up, residual, block_n=8, block_k=32, splits=splits, norm_weight=norm_weight, eps=1e-6)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_inner, want_inner, rtol=tolerance, atol=tolerance)

    want = (residual.float() + kernels.gemv(down, want_inner, bias, block_n=8, block_k=32).float()).to(dtype)
    stream = residual.clone()
    got = kernels.gemv(down, want_inner, bias, block_n=8, block_k=32, splits=splits, residual=stream)
    assert got.data_ptr() == stream.data_ptr()
    torch.testing.assert_close(stream, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("splits, window, qk_norm, dtype", [(1, None, False, torch.float32),
                                                            (3, 5, True, torch.float32),
                                                            (4, None, False, torch.bfloat16),
                                                            (2, None, True, kernels.FP8_KV)])
def test_rotary_decode_attention_is_the_rotary_write_then_the_decode_attention(splits, window, qk_norm,
                                                                               dtype) -> None:
    """The decode step's fused launch against the two it replaces, on a cache of ``dtype``: the same
    cache afterwards (bit for bit) and the same attention output (float32: to summation order;
    16 and 8 bits: to the rounding of the probabilities)."""
    heads, kv_heads, head_dim, lengths, eps = 6, 2, 16, [1, 7, 19], 1e-6
    g = torch.Generator().manual_seed(13)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, torch.float32)
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    qkv_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, qkv_dtype)
    q_norm, k_norm = ((torch.randn(head_dim, generator=g) + 1).to(DEVICE, qkv_dtype) if qk_norm else None
                      for _ in range(2))
    cache = random_cache(16, kv_heads, head_dim).clamp(-8, 8).to(dtype)
    kv_scale = torch.tensor([[0.5, 0.25], [0.5, 1.0]], device=DEVICE) if dtype == kernels.FP8_KV else None
    tables = tables_for(lengths, 16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    positions = seq_lens.long() - 1
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lengths)],
                         device=DEVICE)
    norms = dict(q_norm=q_norm, k_norm=k_norm, eps=eps)

    want_cache = cache.clone()
    q = kernels.rotary_kv_write(qkv, cos, sin, positions, slots, want_cache, heads, kv_scale=kv_scale, **norms)
    want = kernels.paged_decode_attention(q, want_cache, as_tensor(tables), seq_lens, head_dim ** -0.5, window,
                                          num_splits=splits, block_n=16, kv_scale=kv_scale)
    got = kernels.rotary_decode_attention(qkv, cos, sin, positions, slots, cache, heads, as_tensor(tables), seq_lens,
                                          head_dim ** -0.5, window, splits, kv_scale=kv_scale, block_n=16, **norms)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
