"""Decode steps through ``torch.compile``: one static-shape graph per padded batch size.

The graph covers the whole decode forward (embedding to float32 logits). Paged attention is
one opaque op per layer (``torch.ops.vivace.paged_decode_attention``) with tensor inputs
only, so there are no graph breaks, and a graph never depends on sequence lengths or block
ids: the caller pads the batch to a size in ``batch_sizes`` and the block tables to a fixed
width, and one graph per batch size serves every step.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from vivace.layers.attention import DecodeMetadata

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "vivace" / "inductor"


def _decode_logits(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:
    meta = DecodeMetadata(slot_mapping, block_tables, seq_lens)
    return model.compute_logits(model(input_ids, positions, kv_caches, meta))


class CompiledDecoder:
    """Compiled decode forwards of ``model`` over ``kv_caches``, one per size in ``batch_sizes``.

    Compiled artifacts go to inductor's on-disk caches under ``TORCHINDUCTOR_CACHE_DIR``
    (``~/.cache/vivace/inductor`` unless the environment names another), so a process that
    compiles the same model again mostly loads them.
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], batch_sizes: Sequence[int]) -> None:
        os.environ.setdefault(CACHE_DIR_ENV, str(DEFAULT_CACHE_DIR))
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(set(batch_sizes))
        # Every size is its own graph of the same code; keep dynamo from giving up on them.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(self.batch_sizes))
        self._forward = torch.compile(functools.partial(_decode_logits, model), fullgraph=True, dynamic=False)

    def padded_size(self, num_seqs: int) -> int | None:
        """The batch size a batch of ``num_seqs`` sequences is padded to; None if it is too large."""
        index = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        """Float32 logits ``[batch, vocab]``; ``batch`` must be one of ``batch_sizes``."""
        return self._forward(input_ids, positions, self.kv_caches,
                             meta.slot_mapping, meta.block_tables, meta.seq_lens)
