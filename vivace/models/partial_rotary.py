"""Partial rotary (Phi-4-mini) on vivace's full-rotary kernels, by reordering head dims at load.

Transformers rotates only the first ``r`` of each head's ``D`` dims, in pairs (i, i + r/2), and
passes the rest; every vivace kernel rotates pairs (i, i + D/2) of the whole head. Reordering the
q and k projections' output rows within each head (the same order for both, so q·k is unchanged;
v untouched) puts HF's pair (i, i + r/2) at vivace's (i, i + D/2) for i < r/2 and the pass-through
dims in the other slots, where ``rotary_tables`` holds cos 1 and sin 0.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from vivace.models.config import ModelConfig

Rows = TypeVar("Rows", torch.Tensor, np.ndarray)
_PROJECTIONS = ("q_proj", "k_proj", "qkv_proj")
_NORMS = ("q_norm", "k_norm")


def head_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """``order[j]``: the HF dim that vivace's dim ``j`` of a head holds."""
    half, pass_half = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(half), rotary_dim + np.arange(pass_half),
                           half + np.arange(half), rotary_dim + pass_half + np.arange(pass_half)])


def row_order(hf_name: str, config: ModelConfig) -> np.ndarray | None:
    """The order that takes the rows of checkpoint tensor ``hf_name`` (HF names: q/k/qkv projection
    weights and biases, q/k norm weights) to vivace's layout; None when they stay as they are."""
    if config.rotary_dim is None:
        return None
    *_, module, _ = hf_name.split(".")
    head = head_order(config.head_dim, config.rotary_dim)
    if module in _NORMS:
        return head
    if module not in _PROJECTIONS:
        return None
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def heads(count: int, start: int) -> np.ndarray:
        return (start + config.head_dim * np.arange(count)[:, None] + head).reshape(-1)

    if module == "q_proj":
        return heads(config.num_attention_heads, 0)
    if module == "k_proj":
        return heads(config.num_key_value_heads, 0)
    return np.concatenate([heads(config.num_attention_heads, 0), heads(config.num_key_value_heads, q_size),
                           q_size + kv_size + np.arange(kv_size)])


def to_vivace_rows(hf_name: str, rows: Rows, config: ModelConfig) -> Rows:
    """``rows`` (a tensor's or block array's first axis, in HF order) of checkpoint tensor
    ``hf_name`` in vivace's order (``row_order``)."""
    order = row_order(hf_name, config)
    if order is None:
        return rows
    return rows[torch.from_numpy(order)] if isinstance(rows, torch.Tensor) else rows[order]
