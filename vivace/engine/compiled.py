"""Compiled decode steps: the whole decode forward, embedding to float32 logits.

Paged attention is one opaque op per layer (``torch.ops.vivace.paged_decode_attention``) with
tensor inputs only, and block tables always have the same width, so no graph depends on
sequence lengths or block ids. Models whose weights are plain tensors (the quantized ones) run
one AOTInductor graph for every batch size, loaded in milliseconds from its on-disk package
(``vivace.engine.aot_decode``). Others (oneDNN-prepacked float linears, which a package cannot
bind) go through ``torch.compile``: one graph for a single sequence (fully static) and one whose
batch size is symbolic (2 to ``max_batch``); a process re-traces both on start and loads
inductor's cached code (~12 s for the default model).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
from torch import nn

from vivace.engine import aot_decode
from vivace.layers.attention import DecodeMetadata

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "vivace" / "inductor"

logger = logging.getLogger(__name__)


class CompiledDecoder:
    """The compiled decode forward of ``model`` over ``kv_caches`` for 1 to ``max_batch`` sequences.

    ``backend`` says which compiler serves it: "aot" (AOTInductor package under ``aot_cache_dir``,
    default ``~/.cache/vivace/aoti``) or "dynamo" (``torch.compile``, whose artifacts go to
    inductor's caches under ``TORCHINDUCTOR_CACHE_DIR``, ``~/.cache/vivace/inductor`` unless the
    environment names another). A package that cannot be built falls back to "dynamo" (logged).
    With ``compile_missing`` False the package must already be there: what loading it raises is
    raised (a package compiled in the background, ``aot_decode.BackgroundBuild``).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 aot_cache_dir: Path | None = None, compile_missing: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self._aot: aot_decode.AOTDecoder | None = None
        if aot_decode.supported(model):
            try:
                self._aot = aot_decode.AOTDecoder(model, kv_caches, max_batch, aot_cache_dir, compile_missing)
            except Exception as exc:  # export or AOT compilation failed: torch.compile still may not
                if not compile_missing:
                    raise
                logger.warning("vivace: AOTInductor decode graph unavailable (%s); using torch.compile", exc)
        if self._aot is None:
            os.environ.setdefault(CACHE_DIR_ENV, str(DEFAULT_CACHE_DIR))
            self._forward = torch.compile(functools.partial(aot_decode.decode_logits, model),
                                          fullgraph=True, dynamic=False)

    @property
    def backend(self) -> str:
        return "dynamo" if self._aot is None else "aot"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata,
                 logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[num_seqs, vocab]`` for one new token per row (1 to ``max_batch`` rows),
        or ``[len(logit_rows), vocab]`` of those rows only."""
        prompt_rows = meta.prompt_rows if meta.prompt_rows is not None else torch.zeros_like(meta.seq_lens)
        inputs = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, prompt_rows)
        if self._aot is not None:
            return self._aot(*inputs, logit_rows)
        if len(input_ids) > 1:
            # The bound's only job is to be finite; the runner never sends more than max_batch.
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 0, min=2, max=max(self.max_batch, 3))
        logits = self._forward(input_ids, positions, self.kv_caches, *inputs[2:])
        return logits if logit_rows is None else logits[logit_rows]
