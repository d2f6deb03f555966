"""The CUDA runner: the engine's runner seam (``execute``, ``clear_blocks``, ``compiled_rows``)
over KV blocks in device memory, the Triton forward of ``vivace.gpu.forward``, and one CUDA graph
per decode batch bucket.

Host work per step: the batch's ids, positions, slots, block tables and lengths are built with
numpy and copied to the device in one pinned transfer per tensor; logits rows come back to the
host for the (shared) sampler. Every batch runs the same kernels: a decode batch (one new token
per sequence) the decode attention, any other (prompt chunks, prefix-cache hits, speculative
verification rows, mixed batches) the prefill attention with per-sequence query ranges.

On a CPU device the same code runs under Triton's interpreter (tests); graphs are CUDA only.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import PromptPath
from vivace.engine.scheduler import ScheduledBatch
from vivace.gpu import kernels
from vivace.gpu.forward import GpuBatch, check_supported, forward
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, up to ``max_batch``."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | ({max_batch} if max_batch else set()))


class CudaRunner:
    """Owns the device KV pool (one tensor per layer, one scratch block past the pool's blocks,
    where padding rows write) and turns a scheduled batch into float32 logits on the host."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 max_model_len: int, device: str = "cuda", cuda_graph_max_batch: int = 0) -> None:
        check_supported(loaded.model)
        self.model = loaded.model
        self.config = loaded.config
        self.device = torch.device(device)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        shape = kv_cache_shape(loaded.config, num_blocks + 1, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device)
                          for _ in range(loaded.config.num_hidden_layers)]
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, cuda_graph_max_batch)

    @property
    def compiled_rows(self) -> int:
        """The most rows a decode step may have and still replay a graph; 0 without graphs."""
        return self.graphs.max_batch if self.graphs is not None else 0

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero the K/V of ``block_ids`` (a failed forward may have left NaN there)."""
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            for cache in self.kv_caches:
                cache.index_fill_(1, index, 0.0)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def build_batch(self, batch: ScheduledBatch, kv: KVCacheManager) -> tuple[GpuBatch, bool]:
        """The batch's tensors, and whether it is a decode batch (one new token per sequence)."""
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        query_lens = list(batch.num_new_tokens)
        for request, num_new in zip(batch.requests, query_lens):
            start = request.num_computed_tokens
            end = start + num_new
            ids += request.token_ids[start:end] + request.spec_token_ids[:max(end - request.num_tokens, 0)]
            positions += range(start, end)
            tables.append(kv.block_ids(request.request_id))
            seq_lens.append(end)
        width = max(map(len, tables))
        block_tables = np.full((len(tables), width), self.scratch_block, dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        pos = np.array(positions, dtype=np.int64)
        seq_of_row = np.repeat(np.arange(len(tables)), query_lens)
        slots = block_tables[seq_of_row, pos // self.block_size].astype(np.int64) * self.block_size
        slots += pos % self.block_size
        decode = all(n == 1 for n in query_lens)
        query_start = None
        if not decode:
            query_start = self._tensor(np.cumsum([0] + query_lens, dtype=np.int32))
        gpu = GpuBatch(self._tensor(np.array(ids, dtype=np.int64)), self._tensor(pos), self._tensor(slots),
                       self._tensor(block_tables), self._tensor(np.array(seq_lens, dtype=np.int32)), query_start,
                       max(query_lens), kernels.decode_splits(max(seq_lens), len(tables), self.config.num_key_value_heads)
                       if self.device.type == "cuda" else 1)
        return gpu, decode

    def path(self, batch: ScheduledBatch) -> PromptPath:
        """ROWS when a decode graph replays the batch (decodes alone, within the largest bucket);
        PREFILL, the general forward, otherwise: what the pacer's cost model learns per path."""
        if self.graphs is not None and all(n == 1 for n in batch.num_new_tokens) \
                and len(batch.requests) <= self.graphs.max_batch:
            return PromptPath.ROWS
        return PromptPath.PREFILL

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """Run the batch (writing its K/V); float32 logits ``[len(logit_indices), vocab]`` on the
        host at those flat token indices, or None when no logits are wanted this step."""
        if self.path(batch) is PromptPath.ROWS:
            tables = [kv.block_ids(r.request_id) for r in batch.requests]
            logits = self.graphs.replay([r.token_ids[r.num_computed_tokens] for r in batch.requests],
                                        [r.num_computed_tokens for r in batch.requests], tables)
            return logits[logit_indices].float().cpu() if logit_indices else None
        gpu, _ = self.build_batch(batch, kv)
        hidden = forward(self.model, gpu, self.kv_caches)
        if not logit_indices:
            return None
        rows = torch.tensor(logit_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).float().cpu()


class DecodeGraphs:
    """One CUDA graph per decode bucket (``graph_buckets``), captured at start: embedding, every
    layer, final norm and LM head, over static input buffers as wide as the context. A batch
    replays the smallest bucket that holds it; padding rows decode token 0 at position 0 into
    the scratch block. Split-K is fixed per bucket (the kernel sizes each split from the row's
    own length, so a short sequence leaves most splits empty)."""

    def __init__(self, runner: CudaRunner, max_batch: int) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device, width = runner.device, runner.max_blocks_per_seq
        self.ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.tables = torch.full((self.max_batch, width), runner.scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _step(self, size: int) -> torch.Tensor:
        runner = self.runner
        splits = kernels.decode_splits(runner.max_model_len, size, runner.config.num_key_value_heads)
        batch = GpuBatch(self.ids[:size], self.positions[:size], self.slots[:size], self.tables[:size],
                         self.seq_lens[:size], None, 1, splits)
        return runner.model.compute_logits(forward(runner.model, batch, runner.kv_caches))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._reset_padding(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in self.buckets:  # compile every kernel variant before capturing
                self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.buckets):  # largest first: the others reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._step(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batches %s", self.buckets)

    def _reset_padding(self, start: int) -> None:
        scratch_slot = self.runner.scratch_block * self.runner.block_size
        self.ids[start:].zero_()
        self.positions[start:].zero_()
        self.slots[start:].fill_(scratch_slot)
        self.tables[start:].fill_(self.runner.scratch_block)
        self.seq_lens[start:].fill_(1)

    def replay(self, ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits ``[bucket, vocab]`` (rows past ``len(ids)`` are padding) of one decode step."""
        n = len(ids)
        size = next(s for s in self.buckets if s >= n)
        runner = self.runner
        block_tables = np.full((size, runner.max_blocks_per_seq), runner.scratch_block, dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        pos = np.zeros(size, dtype=np.int64)
        pos[:n] = positions
        slots = np.full(size, runner.scratch_block * runner.block_size, dtype=np.int64)
        slots[:n] = block_tables[np.arange(n), pos[:n] // runner.block_size].astype(np.int64) * runner.block_size
        slots[:n] += pos[:n] % runner.block_size
        seq_lens = np.ones(size, dtype=np.int32)
        seq_lens[:n] = pos[:n] + 1
        padded_ids = np.zeros(size, dtype=np.int64)
        padded_ids[:n] = ids
        for buffer, array in ((self.ids, padded_ids), (self.positions, pos), (self.slots, slots),
                              (self.tables, block_tables), (self.seq_lens, seq_lens)):
            buffer[:size].copy_(torch.from_numpy(array).pin_memory(), non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits
