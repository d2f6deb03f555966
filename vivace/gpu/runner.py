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
per-sequence query ranges, its decode rows (if any may be there) the decode attention beside it.

On a CPU device the same code runs under Triton's interpreter (tests); graphs are CUDA only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import PromptPath
from vivace.engine.request import Request
from vivace.engine.scheduler import ScheduledBatch
from vivace.gpu import kernels, kv_fp8
from vivace.gpu.forward import GpuBatch, check_supported, choose_gemv, forward
from vivace.gpu.sampler import ALL_PLANS, DeviceSampler, DeviceSamples, SamplerPlan
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape

logger = logging.getLogger(__name__)


@dataclass
class Launched:
    """A step queued on the device whose tokens the host has not read yet (``CudaRunner.launch``):
    row i drew ``requests[i]``'s next token. ``tokens`` holds them on the device (what a step
    launched after this one reads its input ids from), ``host`` is the packed sampler output on
    its way to the host, complete once ``copied`` (None on a CPU device: already there)."""

    requests: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None


@dataclass
class HostBatch:
    """A flat batch on the host (``CudaRunner.host_arrays``): a row per token, a table per sequence."""

    ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slots: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, width] int32
    seq_lens: np.ndarray  # [num_seqs] int32: tokens after this step
    query_start: np.ndarray  # [num_seqs + 1] int32


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, up to ``max_batch``."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | ({max_batch} if max_batch else set()))


class CudaRunner:
    """Owns the device KV pool (one tensor per layer, one scratch block past the pool's blocks,
    where padding rows write; a float8 pool's scales beside it, ``vivace.gpu.kv_fp8``) and turns a
    scheduled batch into sampled tokens (or float32 logits) on the host. ``max_num_seqs`` sizes the
    device sampler; ``seed`` seeds its unseeded draws. With graphs, batches of up to
    ``verify_batch`` sequences verifying 1 to ``verify_tokens`` speculative proposals each replay
    graphs of their own (``DecodeGraphs.replay_verify``)."""

    # A step with a prompt chunk never rides a decode graph's rows (``path``: PREFILL); it runs the
    # general forward, from a prompt-step graph (``PrefillGraphs``) or eagerly, whose fixed cost
    # (eagerly ~18 ms of host launches for an 8B model on an H200, a 6 ms decode step) outweighs
    # its chunk's tokens: the engine's pacer offers prompts no rows path and fills that step
    # (vivace.engine.pacer, ``fill_eager``), from the costs it measures.
    eager_prompt_steps = True

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 max_model_len: int, device: str = "cuda", cuda_graph_max_batch: int = 0,
                 max_num_seqs: int = 256, seed: int = 0, verify_batch: int = 0, verify_tokens: int = 0,
                 prefill_graph_tokens: int = 0) -> None:
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
        # Batch-1 projections through the Triton GEMV where it beats cuBLAS on this GPU (timed now).
        self.gemv_choices = choose_gemv(self.model) if self.device.type == "cuda" else {}
        for name, choice in self.gemv_choices.items():
            logger.info("batch-1 %s: default %.1f us, best candidate %.1f us: %s", name, choice.default_us,
                        choice.best_us, choice.kept)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch:  # on a CPU device (tests), eager stand-ins for the graphs
            self.graphs = DecodeGraphs(self, cuda_graph_max_batch, min(verify_batch, cuda_graph_max_batch),
                                       verify_tokens)
        self.prefill_graphs: PrefillGraphs | None = None
        if cuda_graph_max_batch and prefill_graph_tokens:
            self.prefill_graphs = PrefillGraphs.capture_or_none(self, prefill_graph_tokens, cuda_graph_max_batch)

    @property
    def compiled_rows(self) -> int:
        """The most rows a decode step may have and still replay a graph; 0 without graphs. Prompt
        rows never ride one (``eager_prompt_steps``)."""
        return self.graphs.max_batch if self.graphs is not None else 0

    @property
    def prompt_step_buckets(self) -> list[int]:
        """The token counts of the prompt-step graphs: a step with prompt tokens costs its bucket's
        replay, whatever it carries below it (the pacer fills them). Empty when such steps run eagerly."""
        return self.prefill_graphs.buckets if self.prefill_graphs is not None else []

    def device_fault(self, exc: Exception) -> bool:
        """Whether ``exc``, raised by a step, left the device unusable: a CUDA error (an illegal
        address, a failed launch) is sticky, so every later launch fails too; an out-of-memory
        error or a bad batch is not."""
        accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
        if (accelerator_error is not None and isinstance(exc, accelerator_error)) or "CUDA error" in str(exc):
            return True
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                return True
        return False

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

    def host_arrays(self, batch: ScheduledBatch, kv: KVCacheManager) -> HostBatch:
        """The batch's ids, positions, K/V slots, block tables and lengths, on the host."""
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
        return HostBatch(np.array(ids, dtype=np.int64), pos, slots, block_tables, np.array(seq_lens, dtype=np.int32),
                         np.cumsum([0] + query_lens, dtype=np.int32))

    def build_batch(self, batch: ScheduledBatch, kv: KVCacheManager) -> tuple[GpuBatch, bool]:
        """The batch's tensors, and whether it is a decode batch (one new token per sequence)."""
        host = self.host_arrays(batch, kv)
        decode = all(n == 1 for n in batch.num_new_tokens)
        query_start = None if decode else self._tensor(host.query_start)
        # a prompt step's decode rows: the decode kernel's, launched only when there are some
        singles = host.seq_lens[np.diff(host.query_start) == 1]
        gpu = GpuBatch(self._tensor(host.ids), self._tensor(host.positions), self._tensor(host.slots),
                       self._tensor(host.block_tables), self._tensor(host.seq_lens), query_start,
                       max(batch.num_new_tokens), self.decode_splits(host.seq_lens),
                       0 if decode or not len(singles) else self.decode_splits(singles))
        return gpu, decode

    def decode_splits(self, seq_lens: np.ndarray) -> int:
        """Split-K of an eager step's decode attention over sequences of ``seq_lens`` tokens
        (``kernels.decode_splits``; 1 on a CPU device)."""
        if self.device.type != "cuda":
            return 1
        return kernels.decode_splits(int(seq_lens.max()), len(seq_lens), self.config.num_key_value_heads)

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
        verify = self._verify_inputs(batch, kv)
        if verify is not None:  # the graph's rows are the batch's, in order
            return self.graphs.replay_verify(*verify)[logit_indices].float().cpu()
        logits = self._logits(batch, kv, logit_indices)
        return None if logits is None else logits.float().cpu()

    @torch.inference_mode()
    def execute_sampled(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int],
                        requests: list[Request]) -> DeviceSamples:
        """Run the batch (writing its K/V) and draw ``requests[i]``'s next token from the logits at
        flat token index ``logit_indices[i]`` on the device; only the tokens (and logprobs) come
        back. ``samples_on_device(requests)`` must hold."""
        return self.collect(self.launch(batch, kv, logit_indices, requests))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int],
               requests: list[Request]) -> Launched:
        """``execute_sampled`` without waiting for the tokens: the batch's forward and sampling
        are queued on the device and the packed tokens start for the host; ``collect`` reads
        them."""
        if self.path(batch) is PromptPath.ROWS:
            rows: list[Request | None] = [None] * len(batch.requests)
            for index, request in zip(logit_indices, requests):
                rows[index] = request
            packed = self._rows(self.graphs.replay_sampled(*self._decode_inputs(batch, kv), rows), logit_indices)
        else:
            packed = self.sampler.sample(self._logits(batch, kv, logit_indices), self.sampler.stage(list(requests)))
        return self._launched(packed, requests)

    @torch.inference_mode()
    def launch_next(self, previous: Launched, requests: list[Request], kv: KVCacheManager) -> Launched:
        """Queue the decode step after ``previous`` before its tokens reach the host: each of
        ``requests`` (each one of ``previous``'s, its K/V slots allocated for one more token)
        decodes the token ``previous`` drew for it, read on the device, at position
        ``num_tokens`` (the host has not appended that token yet), and draws the one after."""
        ids = self._rows(previous.tokens, [previous.requests.index(request) for request in requests])
        positions = [request.num_tokens for request in requests]
        tables = [kv.block_ids(request.request_id) for request in requests]
        if self.graphs is not None and len(requests) <= self.graphs.max_batch:
            packed = self.graphs.replay_sampled(ids, positions, tables, list(requests), ahead=1)
        else:
            arrays = paged_arrays(positions, 1, tables, len(requests), max(map(len, tables)), self.scratch_block,
                                  self.block_size)
            gpu = GpuBatch(ids.long(), *map(self._tensor, arrays), None, 1, self.decode_splits(arrays[3]))
            logits = self.model.compute_logits(forward(self.model, gpu, self.kv_caches, self.kv_scales))
            packed = self.sampler.sample(logits, self.sampler.stage(list(requests), ahead=1))
        return self._launched(packed[:len(requests)], requests)

    def _rows(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``tensor[rows]``: a view when they are its first rows in order, else a gather on the device."""
        if rows == list(range(len(rows))):
            return tensor[:len(rows)]
        return tensor[torch.tensor(rows, dtype=torch.long, device=self.device)]

    def _launched(self, packed: torch.Tensor, requests: list[Request]) -> Launched:
        if self.device.type != "cuda":
            return Launched(list(requests), packed[:, 0], packed.clone(), None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)  # queued before any later step can overwrite ``packed``
        copied = torch.cuda.Event()
        copied.record()
        return Launched(list(requests), packed[:, 0], host, copied)

    def collect(self, launched: Launched) -> DeviceSamples:
        """Wait for a launched step's tokens (and logprobs) and read them."""
        if launched.copied is not None:
            launched.copied.synchronize()
        return self.sampler.read(launched.host, list(range(len(launched.requests))), launched.requests)

    def _verify_inputs(self, batch: ScheduledBatch, kv: KVCacheManager
                       ) -> tuple[list[list[int]], list[int], list[list[int]]] | None:
        """A verification batch's rows (each sequence's last token and its K proposals), first
        positions and block tables, when a verify graph replays it: every request checks the
        same K proposals (1 <= K <= the graphs' most) and there are few enough; else None."""
        graphs = self.graphs
        if graphs is None or not graphs.verify_buckets or len(batch.requests) > graphs.verify_buckets[-1]:
            return None
        k = len(batch.requests[0].spec_token_ids)
        if not 1 <= k <= graphs.verify_tokens or any(
                len(r.spec_token_ids) != k or n != k + 1 or r.num_tokens - r.num_computed_tokens != 1
                for r, n in zip(batch.requests, batch.num_new_tokens)):
            return None
        return ([[r.token_ids[-1], *r.spec_token_ids] for r in batch.requests],
                [r.num_computed_tokens for r in batch.requests], [kv.block_ids(r.request_id) for r in batch.requests])

    def _decode_inputs(self, batch: ScheduledBatch, kv: KVCacheManager
                       ) -> tuple[list[int], list[int], list[list[int]]]:
        """A decode batch's new token ids, their positions and the block tables, for a graph."""
        return ([r.token_ids[r.num_computed_tokens] for r in batch.requests],
                [r.num_computed_tokens for r in batch.requests], [kv.block_ids(r.request_id) for r in batch.requests])

    def _logits(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """The forward of any batch: logits ``[len(logit_indices), vocab]`` on the device, from a
        prefill graph where one holds the batch, else eager."""
        graphs = self.prefill_graphs
        if graphs is not None and logit_indices and graphs.holds(batch, len(logit_indices)):
            return graphs.replay(self.host_arrays(batch, kv), logit_indices)
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

    def __init__(self, runner: CudaRunner, max_batch: int, verify_batch: int = 0, verify_tokens: int = 0) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        # Speculative verification: sequences of K + 1 rows (the last token, K proposals) through
        # the prefill attention, one graph per (bucket, K).
        # A verify bucket holds at most max_batch sequences (the runner caps verify_batch).
        self.verify_buckets = graph_buckets(verify_batch) if verify_tokens else []
        self.verify_tokens = verify_tokens
        device, width = runner.device, runner.max_blocks_per_seq
        self.v_starts = {(size, k): torch.arange(0, size * (k + 1) + 1, k + 1, dtype=torch.int32, device=device)
                         for size in self.verify_buckets for k in range(1, verify_tokens + 1)}
        self.verify_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | EagerGraph, torch.Tensor]] = {}
        # Static inputs of every graph (one replays at a time): a row per token, a table per sequence.
        rows = max(self.max_batch, max(self.verify_buckets or [0]) * (verify_tokens + 1))
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.full((self.max_batch, width), runner.scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | EagerGraph, torch.Tensor]] = {}
        self.sampler_graphs: dict[tuple[int, SamplerPlan], tuple[torch.cuda.CUDAGraph | EagerGraph, torch.Tensor]] = {}
        self.cuda = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._capture_all()

    def _verify_step(self, size: int, k: int) -> torch.Tensor:
        n = size * (k + 1)
        batch = GpuBatch(self.ids[:n], self.positions[:n], self.slots[:n], self.tables[:size], self.seq_lens[:size],
                         self.v_starts[size, k], k + 1)
        return self.runner.model.compute_logits(forward(self.runner.model, batch, self.runner.kv_caches,
                                                                  self.runner.kv_scales))

    def _step(self, size: int) -> torch.Tensor:
        runner = self.runner
        splits = kernels.decode_splits(runner.max_model_len, size, runner.config.num_key_value_heads)
        batch = GpuBatch(self.ids[:size], self.positions[:size], self.slots[:size], self.tables[:size],
                         self.seq_lens[:size], None, 1, splits)
        return runner.model.compute_logits(forward(runner.model, batch, runner.kv_caches, runner.kv_scales))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._reset_padding(0)
        sampler = self.runner.sampler
        if self.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for size in self.buckets:  # compile every kernel variant before capturing
                    logits = self._step(size)
                    for plan in ALL_PLANS:
                        sampler.sample(logits, plan)
                for size, k in self.v_starts:
                    self._pad_verify(size, k)
                    self._verify_step(size, k)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        for size in reversed(self.buckets):  # largest first: the others reuse its memory
            self.graphs[size] = self._capture(partial(self._step, size))
        for size in reversed(self.buckets):
            logits = self.graphs[size][1]
            for plan in ALL_PLANS:
                self.sampler_graphs[size, plan] = self._capture(partial(sampler.sample, logits, plan))
        for size, k in self.v_starts:
            self._pad_verify(size, k)
            self.verify_graphs[size, k] = self._capture(partial(self._verify_step, size, k))
        if self.cuda:
            torch.cuda.synchronize()
        logger.info("%s for decode batches %s", "CUDA graphs captured" if self.cuda else "eager graph stand-ins",
                    self.buckets)

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph | EagerGraph, torch.Tensor]:
        return capture(step, self.pool)

    def _reset_padding(self, start: int) -> None:
        scratch_slot = self.runner.scratch_block * self.runner.block_size
        self.ids[start:].zero_()
        self.positions[start:].zero_()
        self.slots[start:].fill_(scratch_slot)
        self.tables[start:].fill_(self.runner.scratch_block)
        self.seq_lens[start:].fill_(1)

    def replay(self, ids: list[int] | torch.Tensor, positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits ``[bucket, vocab]`` (rows past ``len(ids)`` are padding) of one decode step;
        ``ids`` may be on the device already (a step launched before its input ids reached the host)."""
        n = len(ids)
        size = next(s for s in self.buckets if s >= n)
        self._stage(positions, 1, tables, size)
        if isinstance(ids, torch.Tensor):
            self.ids[:n].copy_(ids)
            self.ids[n:size].zero_()
        else:
            padded_ids = np.zeros(size, dtype=np.int64)
            padded_ids[:n] = ids
            self.ids[:size].copy_(self._host(padded_ids), non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits

    def _pad_verify(self, size: int, k: int) -> None:
        """Every sequence of a verify bucket as padding: rows at positions 0..k in the scratch block."""
        self._stage_verify(size, k, [], [], [])

    def _stage_verify(self, size: int, k: int, rows: list[list[int]], starts: list[int],
                      tables: list[list[int]]) -> None:
        ids = np.zeros(size * (k + 1), dtype=np.int64)
        ids[:len(rows) * (k + 1)] = np.array(rows, dtype=np.int64).reshape(-1) if rows else []
        self.ids[:len(ids)].copy_(self._host(ids), non_blocking=True)
        self._stage(starts, k + 1, tables, size)

    def _stage(self, starts: list[int], query_len: int, tables: list[list[int]], size: int) -> None:
        """Positions, slots, block tables and lengths of ``size`` sequences of ``query_len`` rows
        (``paged_arrays``) into the static buffers."""
        runner = self.runner
        arrays = paged_arrays(starts, query_len, tables, size, runner.max_blocks_per_seq, runner.scratch_block,
                              runner.block_size)
        for buffer, array in zip((self.positions, self.slots, self.tables, self.seq_lens), arrays):
            buffer[:len(array)].copy_(self._host(array), non_blocking=True)

    def replay_verify(self, rows: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits ``[bucket * (K + 1), vocab]`` of a verification step: sequence i's rows
        ``rows[i]`` (its last token, then K proposals) at positions ``starts[i]`` on; the batch's
        rows come first, in order, padding sequences after them."""
        k = len(rows[0]) - 1
        size = next(s for s in self.verify_buckets if s >= len(rows))
        self._stage_verify(size, k, rows, starts, tables)
        graph, logits = self.verify_graphs[size, k]
        graph.replay()
        return logits

    def _host(self, array: np.ndarray) -> torch.Tensor:
        return host_tensor(array, self.cuda)

    def replay_sampled(self, ids: list[int] | torch.Tensor, positions: list[int], tables: list[list[int]],
                       rows: list[Request | None], ahead: int = 0) -> torch.Tensor:
        """``replay``, then the device sampler's graph for ``rows`` (row i samples for ``rows[i]``;
        None and padding rows greedily; ``ahead`` as in ``DeviceSampler.stage``): its packed
        output ``[bucket, width]`` (``DeviceSampler.read``)."""
        logits = self.replay(ids, positions, tables)
        size = logits.shape[0]
        plan = self.runner.sampler.stage(rows + [None] * (size - len(rows)), ahead)  # staged while the forward runs
        graph, packed = self.sampler_graphs[size, plan]
        graph.replay()
        return packed


# Prompt steps of up to this many tokens replay graphs (vLLM captures its piecewise graphs to 512
# tokens too); longer ones run eagerly, their launch cost spread over more compute.
PREFILL_GRAPH_MAX_TOKENS = 512
EMPTY_BATCH = HostBatch(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                        np.zeros((0, 1), dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int32))


# The decode rows a prompt-step graph's split-K is sized for (the graph holds up to max_seqs; which
# rows are decodes is known on the device only). Steps measured at 64 streams carried 10 to 57:
# sized for few, a long context is spread over the GPU where it would serialize one program; with
# many, the splits are shorter and the combine adds a small launch.
MIXED_DECODE_ROWS = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts of the prompt-step graphs: 16, 32, 64, ... below ``max_tokens``, and the power of
    two that holds it."""
    top = 1 << max(max_tokens - 1, 0).bit_length()
    return [t for t in (16, 32, 64, 128, 256) if t < top] + [top]


class PrefillGraphs:
    """One CUDA graph per token bucket (``prefill_buckets``) of the steps that carry prompt tokens
    (whole prompts, chunks beside decode rows, prefix-cache hits): the forward through the prefill
    attention and the LM head of up to ``max_seqs`` rows, over static buffers. Eagerly such a step
    launches ~10 kernels a layer from Python, and on the H200 that cost ~18 ms of host time for any
    prompt length (docs/benchmarks.md) where the 8B shape's 512 tokens compute in ~5 ms.

    A batch of ``n`` tokens in ``s <= max_seqs`` sequences replays the smallest bucket ``T >= n``.
    The ``T - n`` padding tokens are one more sequence of token 0 at position 0, no context, its
    K/V written into and read from the scratch block (finite values, as the decode graphs' padding
    rows); the sequences after it have no queries, so the attention grid, sized at capture for
    ``max_seqs + 1`` sequences of ``T`` queries, scans nothing for them. Sequences of one query
    (decode rows) take the decode attention, GQA-packed, with ``decode_row_splits`` fixed per
    graph; every graph launches it, and its programs of the other sequences do nothing. Capture
    failing (a kernel that will not capture on some device) leaves such steps eager: logged, not
    fatal."""

    def __init__(self, runner: CudaRunner, max_tokens: int, max_seqs: int) -> None:
        self.runner = runner
        self.buckets = prefill_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.max_seqs = max_seqs
        self.decode_row_splits = kernels.decode_splits(runner.max_model_len, min(MIXED_DECODE_ROWS, max_seqs),
                                                       runner.config.num_key_value_heads)
        device, width = runner.device, runner.max_blocks_per_seq
        tokens = self.max_tokens
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slots = torch.zeros(tokens, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_seqs + 1, width, dtype=torch.int32, device=device)  # + the padding's
        self.seq_lens = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.query_start = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_seqs, dtype=torch.long, device=device)  # the tokens whose logits are wanted
        self.cuda = device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | EagerGraph, torch.Tensor]] = {}
        self._capture_all()

    @classmethod
    def capture_or_none(cls, runner: CudaRunner, max_tokens: int, max_seqs: int) -> PrefillGraphs | None:
        try:
            return cls(runner, max_tokens, max_seqs)
        except Exception as exc:  # noqa: BLE001 - a device-specific capture failure keeps the eager path
            if runner.device.type != "cuda":
                raise
            logger.warning("prompt steps stay eager: their CUDA graphs did not capture (%r)", exc)
            torch.cuda.synchronize()
            return None

    def holds(self, batch: ScheduledBatch, logit_rows: int) -> bool:
        """Whether a graph replays ``batch`` with ``logit_rows`` rows of logits (few enough tokens,
        sequences and rows)."""
        return (len(batch.requests) <= self.max_seqs and logit_rows <= self.max_seqs
                and sum(batch.num_new_tokens) <= self.max_tokens)

    def _step(self, tokens: int) -> torch.Tensor:
        runner = self.runner
        batch = GpuBatch(self.ids[:tokens], self.positions[:tokens], self.slots[:tokens], self.tables, self.seq_lens,
                         self.query_start, tokens, decode_row_splits=self.decode_row_splits)
        hidden = forward(runner.model, batch, runner.kv_caches, runner.kv_scales)
        return runner.model.compute_logits(hidden[self.rows])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        if self.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for tokens in self.buckets:  # compile every kernel variant before capturing
                    self._stage(EMPTY_BATCH, [], tokens)
                    self._step(tokens)
            torch.cuda.current_stream().wait_stream(stream)
            pool = torch.cuda.graph_pool_handle()
        for tokens in reversed(self.buckets):  # largest first: the others reuse its memory
            self._stage(EMPTY_BATCH, [], tokens)
            self.graphs[tokens] = capture(partial(self._step, tokens), pool)
        if self.cuda:
            torch.cuda.synchronize()
            logger.info("CUDA graphs captured for prompt steps of up to %s tokens in %d sequences", self.buckets,
                        self.max_seqs)

    def _stage(self, host: HostBatch, logit_indices: list[int], tokens: int) -> None:
        """``host`` into the static buffers, padded to ``tokens`` rows (the padding sequence) and
        ``max_seqs + 1`` sequences."""
        runner = self.runner
        n, seqs = len(host.ids), len(host.seq_lens)
        scratch_slot = runner.scratch_block * runner.block_size
        ids = np.zeros(tokens, dtype=np.int64)
        ids[:n] = host.ids
        positions = np.zeros(tokens, dtype=np.int64)
        positions[:n] = host.positions
        slots = np.full(tokens, scratch_slot, dtype=np.int64)
        slots[:n] = host.slots
        tables = np.full((self.max_seqs + 1, runner.max_blocks_per_seq), runner.scratch_block, dtype=np.int32)
        tables[:seqs, :host.block_tables.shape[1]] = host.block_tables
        seq_lens = np.zeros(self.max_seqs + 1, dtype=np.int32)
        seq_lens[:seqs] = host.seq_lens
        seq_lens[seqs] = tokens - n  # the padding sequence: its queries are its whole length
        query_start = np.full(self.max_seqs + 2, tokens, dtype=np.int32)
        query_start[:seqs + 1] = host.query_start
        rows = np.zeros(self.max_seqs, dtype=np.int64)
        rows[:len(logit_indices)] = logit_indices
        for buffer, array in ((self.ids, ids), (self.positions, positions), (self.slots, slots),
                              (self.tables, tables), (self.seq_lens, seq_lens), (self.query_start, query_start),
                              (self.rows, rows)):
            buffer[:len(array)].copy_(host_tensor(array, self.cuda), non_blocking=True)

    def replay(self, host: HostBatch, logit_indices: list[int]) -> torch.Tensor:
        """Logits ``[len(logit_indices), vocab]`` of the batch ``host`` (``holds`` it), from the
        tokens at flat indices ``logit_indices`` (at most ``max_seqs``)."""
        tokens = next(t for t in self.buckets if t >= len(host.ids))
        self._stage(host, logit_indices, tokens)
        graph, logits = self.graphs[tokens]
        graph.replay()
        return logits[:len(logit_indices)]


def capture(step: Callable[[], torch.Tensor], pool: tuple | None) -> tuple[torch.cuda.CUDAGraph | EagerGraph,
                                                                           torch.Tensor]:
    """``step`` as a CUDA graph in memory ``pool`` and the output it captured; without a pool (a CPU
    device) its eager stand-in."""
    if pool is None:
        graph = EagerGraph(step)
        return graph, graph.output
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):  # synchronizes the device before capturing
        output = step()
    return graph, output


def host_tensor(array: np.ndarray, cuda: bool) -> torch.Tensor:
    """``array`` as a tensor to copy to the device from: pinned on CUDA, so the copy is asynchronous."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if cuda else tensor


class EagerGraph:
    """What stands in for a CUDA graph on a CPU device (tests, under Triton's interpreter): the
    captured function runs once at capture, and again at each ``replay``, its result copied into
    the output the capture returned; so the static buffers, buckets, padding and sampler plans
    around the graphs run and are tested without a GPU."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        self.step = step
        self.output = step()

    def replay(self) -> None:
        self.output.copy_(self.step())


def paged_arrays(starts: list[int], query_len: int, tables: list[list[int]], size: int, width: int,
                 scratch_block: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Positions and K/V slots (``size * query_len``, sequence by sequence), block tables ``[size,
    width]`` and lengths of ``len(starts)`` sequences whose ``query_len`` rows start at ``starts[i]``
    (a decode: one row), padded to ``size`` sequences: padding rows at positions 0 on in the
    scratch block."""
    n = len(starts)
    block_tables = np.full((size, width), scratch_block, dtype=np.int32)
    for row, table in enumerate(tables):
        block_tables[row, :len(table)] = table
    first = np.zeros(size, dtype=np.int64)
    first[:n] = starts
    pos = (first[:, None] + np.arange(query_len)).reshape(-1)
    slots = block_tables[np.repeat(np.arange(size), query_len), pos // block_size].astype(np.int64) * block_size
    slots += pos % block_size
    return pos, slots, block_tables, (first + query_len).astype(np.int32)
