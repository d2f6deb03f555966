"""``torch.ops.vivace.paged_decode_attention``: write each sequence's new K/V, attend its one query.

One call per layer, a tensor-only signature (plus the constant scale) and a fake kernel, so
``torch.compile`` captures a decode forward whole: the op is one opaque node, with no graph
breaks and no recompiles per sequence length. Registered when this module is imported: the
native AVX-512 kernel (``decode_attention.cpp``, built as ``vivace.layers.native`` says), or
``reference_decode_attention`` when the CPU has neither AVX-512 nor AVX2, the build fails, or
``VIVACE_KERNELS=torch``. ``decode_attention_op`` picks the reference for a head size the native
kernel is not built for.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from vivace.layers import native, prefill_attention


def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, window: int = 0, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Store ``k``, ``v`` ``[num_seqs, kv_heads, d]`` at ``slot_mapping`` in ``kv_cache``
    ``[2, num_blocks, block_size, kv_heads, d]``, then attend ``q`` ``[num_seqs, heads, d]`` over the
    first ``seq_lens[i]`` tokens of blocks ``block_tables[i]`` (with ``window`` > 0, only the last
    ``window`` of them); returns ``[num_seqs, heads, d]``.
    Each sequence is attended on its own, over exactly its tokens: a row's result is then the same
    bits whatever else is in the batch (a verify step's rows equal the one-row steps they stand
    for, which greedy speculative decoding relies on); batched over the longest sequence's blocks
    with a mask, PyTorch's attention gave other bits for the same row in another batch.
    ``prompt_rows`` (int64, 1 for a row at a position of its request's prompt) tells the native
    kernel which rows to attend as the prefill kernel does; every row is attended alike here."""
    two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(two, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start = max(seq_len - window, 0) if window > 0 else 0
        blocks = block_tables[i, :-(-seq_len // block_size)]
        rows = kv_cache.index_select(1, blocks).view(two, -1, kv_heads, head_dim)[:, start:seq_len]
        keys, values = rows.transpose(1, 2).to(q.dtype)
        out[i] = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, values, scale=scale,
                                                enable_gqa=kv_heads != q.shape[1]).squeeze(1)
    return out


def _register() -> str:
    """Define the op, and ``vivace::reference_decode_attention`` (the same contract, for the head
    sizes the native kernel is not built for); return which implementation serves the op."""
    backend = "native" if native.load("decode_attention") else "torch"
    names = ["vivace::reference_decode_attention"] + (["vivace::paged_decode_attention"] if backend == "torch" else [])
    for name in names:
        torch.library.custom_op(name, reference_decode_attention, mutates_args=("kv_cache",))
    for name in ("vivace::paged_decode_attention", "vivace::reference_decode_attention"):
        @torch.library.register_fake(name)
        def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
              prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
            return torch.empty_like(q, memory_format=torch.contiguous_format)

    return backend


BACKEND = _register()


def native_supports(head_dim: int) -> bool:
    """Whether the native kernel is built for ``head_dim``: the prefill kernel's sizes (multiples of 16 up
    to 128, and Gemma's 256)."""
    return (BACKEND == "native" and head_dim % 16 == 0
            and (head_dim <= prefill_attention.MAX_HEAD_DIM or head_dim == prefill_attention.WIDE_HEAD_DIM))


def decode_attention_op(head_dim: int) -> torch._ops.OpOverloadPacket:
    """The op that attends heads of ``head_dim``: the native kernel where it is built for them, else
    the reference (any head size: tiny test models' 4 or 24, a head of 160), as llama.cpp serves them."""
    if native_supports(head_dim):
        return torch.ops.vivace.paged_decode_attention
    return torch.ops.vivace.reference_decode_attention
