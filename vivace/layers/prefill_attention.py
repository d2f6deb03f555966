"""``torch.ops.vivace.paged_prefill_attention``: causal attention of a prompt chunk over the paged cache.

``paged_prefill_attention(q, kv_cache, block_table, seq_len, scale)``: ``q`` ``[q_len, heads, d]`` holds
the last ``q_len`` positions of a ``seq_len``-token sequence whose keys and values (already written)
are the first ``seq_len`` slots of the blocks ``block_table`` lists; query ``j`` sits at position
``seq_len - q_len + j`` and sees keys up to there. Returns ``[q_len, heads, d]``.

Registered when this module is imported: the native kernel (``prefill_attention.cpp``, a
flash-style loop reading K/V straight from the cache through the block table; AVX-512, or its
256-bit twin on a CPU with AVX2 only), or ``reference_prefill_attention`` (gather + SDPA) when
the CPU has neither, the build fails, or ``VIVACE_KERNELS=torch``. ``native_supports`` says
whether a call can go to the native kernel.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from vivace.layers import native

# AVX512DQ's VREDUCEPS is in the exp; the flags already cover it.
MAX_HEAD_DIM = 128
WIDE_HEAD_DIM = 256  # Gemma's; the one head_dim above MAX_HEAD_DIM the kernel is built for


def reference_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                seq_len: int, scale: float) -> torch.Tensor:
    """Gather the sequence's K/V and call SDPA (is_causal when ``q_len == seq_len``, else a mask)."""
    return sdpa_prefill_attention(q, kv_cache, block_table, seq_len, scale)


def sdpa_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """The op's contract through SDPA; with ``window``, query ``j`` sees only the last ``window``
    positions up to its own, and only the blocks some query sees are gathered."""
    q_len, block_size = q.shape[0], kv_cache.shape[2]
    if window is not None and seq_len <= window:
        window = None  # every query sees every key
    first_block = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[first_block:num_blocks]].flatten(1, 2)[:, :seq_len - first_block * block_size]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
    keys = blocks[0].transpose(0, 1).unsqueeze(0).to(q.dtype)
    values = blocks[1].transpose(0, 1).unsqueeze(0).to(q.dtype)
    gqa = keys.shape[1] != query.shape[1]
    if q_len == seq_len and window is None:
        attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        key_pos = torch.arange(first_block * block_size, seq_len)[None, :]
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return attended[0].transpose(0, 1).contiguous()


def _register() -> str:
    """Define the op; return which implementation serves it."""
    backend = "native" if native.load("prefill_attention") else "torch"
    if backend == "torch":
        torch.library.custom_op("vivace::paged_prefill_attention", reference_prefill_attention, mutates_args=())

    @torch.library.register_fake("vivace::paged_prefill_attention")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
          scale: float) -> torch.Tensor:
        return q.new_empty(q.shape)

    return backend


BACKEND = _register()
USE_NATIVE = BACKEND == "native"  # benchmarks turn it off to time the SDPA path in the same process


def native_supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the native kernel serves this call (else the caller's SDPA path does)."""
    head_dim = q.shape[-1]
    return (USE_NATIVE and (q.dtype == kv_cache.dtype
                            or (q.dtype == torch.float32 and kv_cache.dtype in (torch.float16, torch.bfloat16)))
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and head_dim % 16 == 0 and (head_dim <= MAX_HEAD_DIM or head_dim == WIDE_HEAD_DIM)
            and kv_cache.is_contiguous())
