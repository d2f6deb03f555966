"""Decode steps through ``torch.compile``: the whole decode forward, embedding to float32 logits.

Paged attention is one opaque op per layer (``torch.ops.vivace.paged_decode_attention``) with
tensor inputs only, and block tables always have the same width, so no graph depends on
sequence lengths or block ids. Two graphs serve every decode step: one for a single sequence
(the latency-critical case, fully static) and one whose batch size is symbolic (2 to
``max_batch``). A symbolic batch costs nothing here, since every matmul is an opaque op, and it
spares both a graph per padded size (each ~5 s to load even from a warm cache) and the
compute that padding rows would waste.
"""

from __future__ import annotations

import functools
import os
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
    """The compiled decode forward of ``model`` over ``kv_caches`` for 1 to ``max_batch`` sequences.

    Compiled artifacts go to inductor's on-disk caches under ``TORCHINDUCTOR_CACHE_DIR``
    (``~/.cache/vivace/inductor`` unless the environment names another), so a process that
    compiles the same model again mostly loads them.
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int) -> None:
        os.environ.setdefault(CACHE_DIR_ENV, str(DEFAULT_CACHE_DIR))
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self._forward = torch.compile(functools.partial(_decode_logits, model), fullgraph=True, dynamic=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        """Float32 logits ``[num_seqs, vocab]`` for one new token per sequence (1 to ``max_batch``)."""
        inputs = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        if len(input_ids) > 1:
            # The bound's only job is to be finite; the runner never sends more than max_batch.
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 0, min=2, max=max(self.max_batch, 3))
        return self._forward(input_ids, positions, self.kv_caches, *inputs[2:])
