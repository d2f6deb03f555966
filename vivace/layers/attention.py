"""Paged attention: K/V are written to and read from a pool of fixed-size blocks.

Cache layout per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import vivace.layers.decode_attention  # noqa: F401  (registers torch.ops.vivace.paged_decode_attention)
from vivace.layers import prefill_attention


@dataclass
class AttentionMetadata:
    """Describes one flat batch. Sequences appear in order; sequence ``i`` contributes
    ``query_lens[i]`` consecutive tokens to the batch and, after this step, attends over
    ``seq_lens[i]`` cached tokens (its earlier context plus the new ones)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class DecodeMetadata:
    """A decode-only batch: token ``i`` is the one new token of sequence ``i``, which then has
    ``seq_lens[i]`` tokens. Tensors only, so torch.compile captures a forward over it without
    graph breaks or recompiles per value; ``block_tables`` may be wider than needed."""

    slot_mapping: torch.Tensor  # [num_seqs] int64
    block_tables: torch.Tensor  # [num_seqs, width] int64
    seq_lens: torch.Tensor  # [num_seqs] int64


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kv_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata, scale: float, window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a batch mixing prefill chunks and decodes.

    q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``.
    Writes k, v to the cache, then returns ``[num_tokens, num_heads, head_dim]``. Decodes
    (one new token) are attended together in one ``paged_decode_attention`` call; prefill
    chunks one by one. A ``DecodeMetadata`` batch is that one call and nothing else. With
    ``window``, each query attends only the last ``window`` positions up to its own (a
    sliding-window layer); the cache still holds, and the block tables still list, every position.
    """
    if isinstance(meta, DecodeMetadata):
        return torch.ops.vivace.paged_decode_attention(q, k, v, kv_cache, meta.slot_mapping, meta.block_tables,
                                                       meta.seq_lens, scale, window or 0)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    starts = [0]
    for q_len in meta.query_lens:
        starts.append(starts[-1] + q_len)
    decodes = [i for i, q_len in enumerate(meta.query_lens) if q_len == 1]
    if decodes:
        # The op stores these rows' K/V again (the same values) before attending them.
        rows = torch.tensor([starts[i] for i in decodes])
        seq_lens = torch.tensor([meta.seq_lens[i] for i in decodes])
        out[rows] = torch.ops.vivace.paged_decode_attention(
            q[rows], k[rows], v[rows], kv_cache, meta.slot_mapping[rows], meta.block_tables[decodes], seq_lens, scale,
            window or 0)
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        if q_len > 1:
            start = starts[i]
            out[start:start + q_len] = _prefill_attention(
                q[start:start + q_len], kv_cache, meta.block_tables[i], seq_len, scale, window)
    return out


def _prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """A chunk of ``q_len`` queries at the end of a ``seq_len``-token sequence. The native kernel
    is causal only: a window that hides some key from some query takes the SDPA path."""
    if (window is None or seq_len <= window) and prefill_attention.native_supports(q, kv_cache):
        return torch.ops.vivace.paged_prefill_attention(q, kv_cache, block_table, seq_len, scale)
    return prefill_attention.sdpa_prefill_attention(q, kv_cache, block_table, seq_len, scale, window)
