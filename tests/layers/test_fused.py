"""Native fused elementwise ops (``vivace/layers/fused.cpp``) against their PyTorch formulations."""

import pytest
import torch
import torch.nn.functional as F

from vivace.layers import fused, rotary

pytestmark = pytest.mark.skipif(not fused.NATIVE, reason="native fused ops did not build on this CPU")

TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _wide(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A strided [rows, cols] view: a slice of a wider row-major tensor, as a fused projection gives."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols + 40, generator=gen) * 3).to(dtype)[:, 8:8 + cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 48), (37, 1536), (5, 13)])
def test_silu_mul(dtype, rows, width):
    x = _wide(rows, 2 * width, dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.vivace.silu_mul(x), F.silu(gate) * up, **TOLERANCES[dtype])


def test_silu_mul_extremes():
    x = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.vivace.silu_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 48), (37, 2048), (5, 13)])
def test_gelu_tanh_mul(dtype, rows, width):
    x = _wide(rows, 2 * width, dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    # 0.5 g (1 + tanh y) computed as g / (1 + exp(-2y)): the same function, rounded differently
    # (a few float32 ulps, and ~1e-37 where PyTorch's tanh gives exactly -1).
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(torch.ops.vivace.gelu_tanh_mul(x), expected, **tolerance)
    torch.testing.assert_close(fused.gelu_tanh_mul(x), expected, **tolerance)


def test_gelu_tanh_mul_extremes():
    x = torch.tensor([[-200.0, -30.0, -3.0, 0.0, 3.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.vivace.gelu_tanh_mul(x), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (33, 576), (3, 40)])
def test_rms_norm_and_the_residual_add(dtype, rows, hidden):
    x, residual = _wide(rows, hidden, dtype, 1), _wide(rows, hidden, dtype, 2).contiguous()
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    expected_sum = residual + x
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), fused._torch_rms_norm(x, weight, 1e-5),
                               **TOLERANCES[dtype])
    normed, new_residual = fused.rms_norm(x, weight, 1e-5, residual.clone())
    torch.testing.assert_close(new_residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(normed, fused._torch_rms_norm(expected_sum, weight, 1e-5), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(12, 64), (3, 16), (2, 40)])
def test_rotary_in_place_on_a_fused_projection_slice(dtype, heads, head_dim):
    num_tokens = 19
    emb = rotary.RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(3))
    cos, sin = emb(positions)
    projection = _wide(num_tokens, heads * head_dim + 64, dtype, 4)
    x = projection[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    expected = rotary.apply_rotary(x.clone(), cos, sin)
    untouched = projection[:, heads * head_dim:].clone()
    out = fused.apply_rotary(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    assert torch.equal(projection[:, heads * head_dim:], untouched)


def test_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="odd width"):
        torch.ops.vivace.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="odd width"):
        torch.ops.vivace.gelu_tanh_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.vivace.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.vivace.rotary_(torch.zeros(2, 3, 8), torch.zeros(3, 4), torch.zeros(3, 4))
