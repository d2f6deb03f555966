"""Paged attention: K/V are written to and read from a pool of fixed-size blocks.

Cache layout per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds keys, 1 values). A token's *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vivace.layers import decode_attention, native, prefill_attention


def kernels_agree(head_dim: int) -> bool:
    """Whether the decode kernel gives a row of heads of ``head_dim`` the very bits the prefill kernel
    gives it (both native AVX-512 builds share one arithmetic, ``attention_math.h``): then either may
    attend a prompt position, and the cheaper one does. The AVX2 (SIMDe) builds and the PyTorch
    fallbacks (every backend's, and the reference op a head size the native kernels lack takes)
    agree only within rounding."""
    return (decode_attention.native_supports(head_dim) and prefill_attention.BACKEND == "native"
            and native.cpu_has(native.AVX512_CPU_FLAGS))


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
    # Per sequence, how many of its new tokens (the first ones) are positions of its prompt; None:
    # a sequence of one new token is a decode, the tokens of a longer one prompt positions.
    prompt_lens: list[int] | None = None

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
    # [num_seqs] int64, 1 where the token is a position of its request's prompt (a prompt chunk
    # riding the step as rows): attended as a prefill step attends it (paged_attention).
    prompt_rows: torch.Tensor | None = None


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
    Writes k, v to the cache, then returns ``[num_tokens, num_heads, head_dim]``. Positions of a
    prompt are attended by the prefill kernel, a sequence's run of them at once; other tokens
    (the next one, proposals to verify, generated tokens recomputed after a preemption), every
    sequence's together, by ``paged_decode_attention``, as one-row steps attend them. A
    ``DecodeMetadata`` batch is one ``paged_decode_attention`` call, which attends its rows
    flagged ``prompt_rows`` as the prefill kernel does: a position gets the same bits whatever
    step carries it. With ``window``, each query attends only the last ``window`` positions up to
    its own (a sliding-window layer); the cache still holds, and the block tables still list,
    every position. With ``meta.prompt_lens`` (the runner's batch_invariant), prompt positions whose
    window hides some key are attended as decodes, as they are in a compiled step.
    """
    if isinstance(meta, DecodeMetadata):
        return decode_attention.decode_attention_op(q.shape[-1])(
            q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale, window or 0, meta.prompt_rows)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    exact = meta.prompt_lens is not None
    prompt_lens = meta.prompt_lens if exact else [0 if q_len == 1 else q_len for q_len in meta.query_lens]
    rows: list[int] = []  # the tokens attended as decodes, their sequences and lengths
    sequences: list[int] = []
    lengths: list[int] = []
    start = 0
    for i, (q_len, seq_len, prompt) in enumerate(zip(meta.query_lens, meta.seq_lens, prompt_lens)):
        first = seq_len - q_len  # the position of the sequence's first new token
        if exact and window is not None:  # prompt rows past the window: as decodes, as in a compiled step
            prompt = min(prompt, max(window - first, 0))
        if prompt:
            out[start:start + prompt] = _prefill_attention(
                q[start:start + prompt], kv_cache, meta.block_tables[i], first + prompt, scale, window)
        rows += range(start + prompt, start + q_len)
        sequences += [i] * (q_len - prompt)
        lengths += range(first + prompt + 1, seq_len + 1)
        start += q_len
    if rows:
        # The op stores these rows' K/V again (the same values) before attending them; flagged as
        # no prompt rows, a long run of them (a recomputed answer) stays in the decode kernel.
        index = torch.tensor(rows)
        out[index] = decode_attention.decode_attention_op(q.shape[-1])(
            q[index], k[index], v[index], kv_cache, meta.slot_mapping[index], meta.block_tables[sequences],
            torch.tensor(lengths), scale, window or 0, torch.zeros(len(rows), dtype=torch.long))
    return out


def _prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, scale: float, window: int | None = None) -> torch.Tensor:
    """A chunk of ``q_len`` queries at the end of a ``seq_len``-token sequence. The native kernel
    is causal only: a window that hides some key from some query takes the SDPA path."""
    if (window is None or seq_len <= window) and prefill_attention.native_supports(q, kv_cache):
        return torch.ops.vivace.paged_prefill_attention(q, kv_cache, block_table, seq_len, scale)
    return prefill_attention.sdpa_prefill_attention(q, kv_cache, block_table, seq_len, scale, window)
