"""The CUDA runner: the engine's runner seam (``execute``, ``clear_blocks``, ``compiled_rows``)
over KV blocks in device memory, the Triton forward of ``vivace.gpu.forward``, and one CUDA graph
per decode batch bucket.

Host work per step: the batch's ids, positions, slots, block tables and lengths are built with
numpy and copied to the device in one pinned transfer per tensor. ``execute_sampled`` draws the
tokens on the device (``vivace.gpu.sampler``, inside the decode graphs) and brings back only them
and their logprobs; ``execute`` brings the logits rows back for the engine's host sampler (batches
the device sampler cannot serve: ``DeviceSampler.supports``). Every batch runs the same kernels:
a decode batch (one new token per sequence) the decode attention, any other (prompt chunks,
prefix-cache hits, speculative verification rows, mixed batches) the prefill attention with
per-sequence query ranges.

On a CPU device the same code runs under Triton's interpreter (tests); graphs are CUDA only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import PromptPath
from vivace.engine.request import Request
from vivace.engine.scheduler import ScheduledBatch
from vivace.gpu import kernels, kv_fp8
from vivace.gpu.forward import GpuBatch, check_supported, forward
from vivace.gpu.sampler import ALL_PLANS, DeviceSampler, DeviceSamples, SamplerPlan
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, up to ``max_batch``."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | ({max_batch} if max_batch else set()))


class CudaRunner:
    """Owns the device KV pool (one tensor per layer, one scratch block past the pool's blocks,
    where padding rows write; a float8 pool's scales beside it, ``vivace.gpu.kv_fp8``) and turns a scheduled batch into sampled tokens (or float32 logits)
    on the host. ``max_num_seqs`` sizes the device sampler; ``seed`` seeds its unseeded draws."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 max_model_len: int, device: str = "cuda", cuda_graph_max_batch: int = 0,
                 max_num_seqs: int = 256, seed: int = 0) -> None:
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
        # float8 (e4m3) caches: per layer, float32 [2, num_kv_heads] scales of keys and values
        self.kv_scales = kv_fp8.kv_scales(loaded, block_size, max_model_len, self.device) \
            if kv_dtype == kernels.FP8_KV else None
        self.sampler = DeviceSampler(max(max_num_seqs, cuda_graph_max_batch), loaded.config.vocab_size, max_model_len,
                                     loaded.config.eos_token_ids, seed, self.device)
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
                # float8 through its bytes: torch has no index_fill_ for it, and byte 0 is +0.0
                (cache.view(torch.uint8) if cache.dtype == kernels.FP8_KV else cache).index_fill_(1, index, 0)

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

    def samples_on_device(self, requests: list[Request]) -> bool:
        """Whether ``execute_sampled`` can draw these requests' tokens (each sampling one row)."""
        return self.sampler.supports(requests)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """Run the batch (writing its K/V); float32 logits ``[len(logit_indices), vocab]`` on the
        host at those flat token indices, or None when no logits are wanted this step."""
        if self.path(batch) is PromptPath.ROWS:
            logits = self.graphs.replay(*self._decode_inputs(batch, kv))
            return logits[logit_indices].float().cpu() if logit_indices else None
        logits = self._logits(batch, kv, logit_indices)
        return None if logits is None else logits.float().cpu()

    @torch.inference_mode()
    def execute_sampled(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int],
                        requests: list[Request]) -> DeviceSamples:
        """Run the batch (writing its K/V) and draw ``requests[i]``'s next token from the logits at
        flat token index ``logit_indices[i]`` on the device; only the tokens (and logprobs) come
        back. ``samples_on_device(requests)`` must hold."""
        if self.path(batch) is PromptPath.ROWS:
            rows: list[Request | None] = [None] * len(batch.requests)
            for index, request in zip(logit_indices, requests):
                rows[index] = request
            packed = self.graphs.replay_sampled(*self._decode_inputs(batch, kv), rows)
            return self.sampler.read(packed, logit_indices, requests)
        return self.sampler.run(self._logits(batch, kv, logit_indices), requests)

    def _decode_inputs(self, batch: ScheduledBatch, kv: KVCacheManager
                       ) -> tuple[list[int], list[int], list[list[int]]]:
        """A decode batch's new token ids, their positions and the block tables, for a graph."""
        return ([r.token_ids[r.num_computed_tokens] for r in batch.requests],
                [r.num_computed_tokens for r in batch.requests], [kv.block_ids(r.request_id) for r in batch.requests])

    def _logits(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """The eager forward of any batch: logits ``[len(logit_indices), vocab]`` on the device."""
        gpu, _ = self.build_batch(batch, kv)
        hidden = forward(self.model, gpu, self.kv_caches, self.kv_scales)
        if not logit_indices:
            return None
        rows = torch.tensor(logit_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])


class DecodeGraphs:
    """One CUDA graph per decode bucket (``graph_buckets``), captured at start: embedding, every
    layer, final norm and LM head, over static input buffers as wide as the context; and beside
    each, one graph of the device sampler over its logits per ``SamplerPlan``, replayed right after
    it (a plan's optional stages cost nothing to the batches that don't need them). A batch
    replays the smallest bucket that holds it; padding rows decode token 0 at position 0 into
    the scratch block and sample greedily. Split-K is fixed per bucket (the kernel sizes each split
    from the row's own length, so a short sequence leaves most splits empty)."""

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
        self.sampler_graphs: dict[tuple[int, SamplerPlan], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _step(self, size: int) -> torch.Tensor:
        runner = self.runner
        splits = kernels.decode_splits(runner.max_model_len, size, runner.config.num_key_value_heads)
        batch = GpuBatch(self.ids[:size], self.positions[:size], self.slots[:size], self.tables[:size],
                         self.seq_lens[:size], None, 1, splits)
        return runner.model.compute_logits(forward(runner.model, batch, runner.kv_caches, runner.kv_scales))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._reset_padding(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        sampler = self.runner.sampler
        with torch.cuda.stream(stream):
            for size in self.buckets:  # compile every kernel variant before capturing
                logits = self._step(size)
                for plan in ALL_PLANS:
                    sampler.sample(logits, plan)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.buckets):  # largest first: the others reuse its memory
            self.graphs[size] = self._capture(lambda: self._step(size))
        for size in reversed(self.buckets):
            logits = self.graphs[size][1]
            for plan in ALL_PLANS:
                self.sampler_graphs[size, plan] = self._capture(lambda: sampler.sample(logits, plan))
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batches %s", self.buckets)

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        return graph, output

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

    def replay_sampled(self, ids: list[int], positions: list[int], tables: list[list[int]],
                       rows: list[Request | None]) -> torch.Tensor:
        """``replay``, then the device sampler's graph for ``rows`` (row i samples for ``rows[i]``;
        None and padding rows greedily): its packed output ``[bucket, width]`` (``DeviceSampler.read``)."""
        logits = self.replay(ids, positions, tables)
        size = logits.shape[0]
        plan = self.runner.sampler.stage(rows + [None] * (size - len(rows)))  # staged while the forward runs
        graph, packed = self.sampler_graphs[size, plan]
        graph.replay()
        return packed
