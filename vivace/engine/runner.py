"""Host-side batch building and the model forward: one flat batch per step."""

from __future__ import annotations

import logging
import math
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from vivace.engine import aot_decode
from vivace.engine.compiled import CompiledDecoder
from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.pacer import LONG_RUN_ROWS, PromptPath
from vivace.engine.scheduler import ScheduledBatch
from vivace.layers.attention import AttentionMetadata, DecodeMetadata, kernels_agree
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape

if TYPE_CHECKING:
    from vivace.config import EngineConfig

logger = logging.getLogger(__name__)

# Without a budget, the pool holds this many max-model-len sequences, capped at a share of the
# machine's memory: enough for the default concurrency of long streams without preemption. The
# pool's pages cost nothing until written (allocate_kv_cache), so the cap bounds what a busy
# server may come to hold, not what it holds at start.
DEFAULT_POOL_SEQUENCES = 16
DEFAULT_POOL_MEMORY_SHARE = 1 / 8


def kv_bytes_per_token(loaded: LoadedModel, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in every layer's cache."""
    config = loaded.config
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def num_blocks_for_budget(loaded: LoadedModel, block_size: int, dtype: torch.dtype, memory_gb: float | None,
                          max_model_len: int) -> int:
    """KV blocks that fit in ``memory_gb`` GiB, or, when it is None, that hold
    ``DEFAULT_POOL_SEQUENCES`` ``max_model_len`` sequences within ``DEFAULT_POOL_MEMORY_SHARE``
    of physical memory (never less than one such sequence): 5.6 GiB, 128k tokens for the default
    model in float32 on a machine of 45 GiB or more (68k tokens, 2.9 GiB, with 23.5 GiB)."""
    per_block = block_size * kv_bytes_per_token(loaded, dtype)
    if memory_gb is not None:
        return max(int(memory_gb * (1 << 30)) // per_block, 1)
    per_sequence = -(-max_model_len // block_size)
    share = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_POOL_MEMORY_SHARE) // per_block
    return max(min(DEFAULT_POOL_SEQUENCES * per_sequence, share), per_sequence)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor in its own anonymous memory mapping: the OS hands out zero pages, and
    commits one only when it is first written, so the unused part of a KV budget costs no resident
    memory (``torch.zeros`` writes, hence commits, every page), while padding still reads zeros,
    never NaN garbage."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


# Where the kernels agree, the run length from which the prefill kernel is the cheaper: measured
# on the default model (3 streams decoding beside the run, depths 128-3,000), runs of 1-4 rows cost
# the decode kernel 0.1-0.9 ms less a step, runs of 6 or more the prefill kernel up to ~10% less.
AGREED_RUN_ROWS = 6


class ModelRunner:
    """Owns the KV tensors and turns a scheduled batch into logits.

    Batches where every sequence has one new token, plus any speculative tokens to verify, take
    ``decode``, one row per token: with ``compile_max_batch`` set, through graphs compiled (or
    loaded from the on-disk cache) here, before the first request, for up to that many rows;
    eagerly otherwise. With compiled graphs, decodes mixed with prompt chunks also take it while
    the rows fit, unless the scheduler sent the chunk the prefill path; other batches with a
    prompt chunk run the eager prefill path (decode rows through the decode attention op, each
    chunk through the paged prefill attention). The cache has one
    block more than the pool hands out: the scratch block, which block-table padding points at.

    A prompt chunk of fewer than ``AGREED_RUN_ROWS`` tokens riding the compiled step is attended by
    the decode kernel (cheaper than the prefill kernel's packing of the context), longer ones by
    the prefill kernel: both give a row the same bits (``kernels_agree``, the AVX-512 builds).
    Where they do not agree bit for bit (AVX2 builds, the PyTorch fallbacks), ``batch_invariant``
    sends every position of a prompt to the prefill kernel and every other one to the decode
    kernel, on either path, so that a greedy answer does not depend on the steps that carried it;
    without it, runs of fewer than ``LONG_RUN_ROWS`` go to the decode kernel (other bits).

    With ``background_compile`` (the engine's config, which loaded this model), a decode graph
    that is not cached yet is compiled by a low-priority child process while this runner decodes
    eagerly; ``swap_in_compiled``, called between steps, takes it up once it is there. A model
    that is not ``compilable`` (a mixture of experts) always runs eagerly.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 max_model_len: int | None = None, compile_max_batch: int = 0,
                 background_compile: EngineConfig | None = None, batch_invariant: bool = False) -> None:
        self.model = loaded.model
        self.batch_invariant = batch_invariant
        # The fewest rows of a prompt chunk riding the compiled step that the prefill kernel attends.
        # Where the two kernels agree bit for bit, whichever is cheaper: the decode kernel up to
        # AGREED_RUN_ROWS - 1 rows (the prefill kernel first packs the whole context).
        if kernels_agree(loaded.config.head_dim):
            self.prefill_run_rows = AGREED_RUN_ROWS
        else:
            self.prefill_run_rows = 1 if batch_invariant else LONG_RUN_ROWS
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = kv_cache_shape(loaded.config, num_blocks + 1, block_size)
        self.kv_caches = [allocate_kv_cache(shape, kv_dtype) for _ in range(loaded.config.num_hidden_layers)]
        self.max_blocks_per_seq = -(-(max_model_len or loaded.config.max_position_embeddings) // block_size)
        self.decoder: CompiledDecoder | None = None
        self.pending_compile: aot_decode.BackgroundBuild | None = None
        if compile_max_batch and not getattr(self.model, "compilable", True):
            logger.info("vivace: %s routes each token by its values (mixture of experts), which no compiled "
                        "decode graph captures: decode steps run eagerly", loaded.config.architecture)
            compile_max_batch = 0
        if compile_max_batch and background_compile is not None and aot_decode.supported(self.model):
            path = aot_decode.package_path(self.model, self.kv_caches, compile_max_batch)
            if not path.exists():
                self.pending_compile = aot_decode.BackgroundBuild(background_compile, compile_max_batch, path)
                logger.info("vivace: decoding eagerly while the decode graph compiles in a background process "
                            "(low priority, a minute or more); it takes over between two steps when ready")
                return
        if compile_max_batch:
            self.decoder = CompiledDecoder(self.model, self.kv_caches, compile_max_batch)
            self.warm_up()

    def swap_in_compiled(self) -> bool:
        """Between steps: once the background compile has finished, decode through its package
        from now on (loaded in milliseconds). True when this call swapped it in."""
        if self.pending_compile is None or (done := self.pending_compile.poll()) is None:
            return False
        build, self.pending_compile = self.pending_compile, None
        if not done:
            return False
        try:
            decoder = CompiledDecoder(self.model, self.kv_caches, build.max_batch, build.path.parent,
                                      compile_missing=False)
        except Exception as exc:  # the package does not load: stay eager, never compile here
            logger.warning("vivace: the background-compiled decode graph did not load (%s); decoding stays eager", exc)
            return False
        self.decoder = decoder
        self.warm_up()
        logger.info("vivace: decode steps now run the compiled graph")
        return True

    @property
    def compiled_rows(self) -> int:
        """The most rows (tokens) a step may have and still run the compiled decode step; 0 without one."""
        return self.decoder.max_batch if self.decoder is not None else 0

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero the K/V of ``block_ids`` in every layer. Attention reads whole blocks and masks
        the slots past a sequence's end, and a masked NaN still poisons the sum (0 * NaN), so a
        block a failed forward may have filled with NaN is cleared before it is reused."""
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.long)
            for cache in self.kv_caches:
                cache.index_fill_(1, index, 0.0)

    def build_inputs(self, batch: ScheduledBatch, kv: KVCacheManager) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        prompt_lens: list[int] = []
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            end = start + num_new
            prompt_lens.append(min(max(request.num_prompt_tokens - start, 0), num_new))
            table = kv.block_ids(request.request_id)
            input_ids.extend(request.token_ids[start:end])
            input_ids.extend(request.spec_token_ids[:max(end - request.num_tokens, 0)])
            positions.extend(range(start, end))
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end))
            tables.append(table)
            seq_lens.append(end)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_lens=list(batch.num_new_tokens),
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            prompt_lens=prompt_lens if self.batch_invariant else None,
        )
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def build_decode_inputs(self, input_ids: list[int], positions: list[int], tables: list[list[int]],
                            width: int, prompt_rows: list[int] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, DecodeMetadata]:
        """Tensors for one new token per sequence at ``positions``, with block tables ``width``
        wide; the columns past a sequence's blocks point at the scratch block. ``prompt_rows``:
        1 for a row at a position of its request's prompt (none when None)."""
        block_tables = np.full((len(tables), width), self.scratch_block, dtype=np.int64)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        pos = np.array(positions, dtype=np.int64)
        slots = block_tables[np.arange(len(tables)), pos // self.block_size] * self.block_size + pos % self.block_size
        flags = torch.zeros(len(tables), dtype=torch.long) if prompt_rows is None else torch.tensor(prompt_rows)
        meta = DecodeMetadata(torch.from_numpy(slots), torch.from_numpy(block_tables), torch.from_numpy(pos + 1), flags)
        return torch.tensor(input_ids, dtype=torch.long), torch.from_numpy(pos), meta

    def decode(self, input_ids: list[int], positions: list[int], tables: list[list[int]],
               logit_rows: list[int] | None = None, prompt_rows: list[int] | None = None) -> torch.Tensor:
        """Float32 logits ``[len(input_ids), vocab]`` for one new token per row, each at its
        position (the sequence then has position + 1 tokens), writing its K/V through ``tables``;
        with ``logit_rows``, ``[len(logit_rows), vocab]`` of those rows only. ``prompt_rows``
        flags the rows at positions of their request's prompt (``build_decode_inputs``)."""
        rows = None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.long)
        if self.decoder is not None and len(input_ids) <= self.decoder.max_batch:
            # A fixed width, so that no graph depends on how long the sequences are.
            return self.decoder(*self.build_decode_inputs(input_ids, positions, tables, self.max_blocks_per_seq,
                                                          prompt_rows), rows)
        ids, pos, meta = self.build_decode_inputs(input_ids, positions, tables, max(map(len, tables)), prompt_rows)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile (or load from the on-disk cache) the decode graphs: one sequence, and several."""
        for num_seqs in (1, 2):
            self.decode([0] * num_seqs, [0] * num_seqs, [[self.scratch_block]] * num_seqs)

    def path(self, batch: ScheduledBatch) -> PromptPath:
        """How the batch runs: as decode rows (ROWS) for decodes and verifies alone, and, with
        compiled graphs, for decodes mixed with prompt chunks the scheduler sent that way while
        the rows fit (the chunks' rows ride the compiled decode step; their logits are computed
        and dropped); on the prefill path otherwise, as does a step of prompts alone."""
        decoding = [n == 1 + len(r.spec_token_ids) for r, n in zip(batch.requests, batch.num_new_tokens)]
        if all(decoding):
            return PromptPath.ROWS
        if (self.decoder is not None and batch.prompt_path is PromptPath.ROWS and any(decoding)
                and sum(batch.num_new_tokens) <= self.decoder.max_batch):
            return PromptPath.ROWS
        return PromptPath.PREFILL

    def execute(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """Run the batch (writing its K/V); return float32 logits ``[len(logit_indices), vocab]``
        at those flat token indices, or None when no logits are wanted this step."""
        if self.path(batch) is PromptPath.ROWS:
            # One row per new token, each attending its own sequence up to its own position:
            # the op writes every row's K/V before attending, so a request's rows (its next
            # token and proposals to verify, or a prompt chunk) may share its block table.
            input_ids, positions, tables, prompt_rows = [], [], [], []
            for request, num_new in zip(batch.requests, batch.num_new_tokens):
                start = request.num_computed_tokens
                tokens = request.token_ids[start:start + num_new]
                input_ids += tokens + request.spec_token_ids[:num_new - len(tokens)]
                positions += range(start, start + num_new)
                tables += [kv.block_ids(request.request_id)] * num_new
                # Positions of the prompt: the prefill kernel's (with batch_invariant, or in chunks it
                # reads faster than the decode kernel would); the others the decode kernel's.
                prefill = num_new >= self.prefill_run_rows
                prompt_rows += [int(prefill and p < request.num_prompt_tokens) for p in range(start, start + num_new)]
            if not logit_indices:  # K/V only; one row's logits is the least
                self.decode(input_ids, positions, tables, [0], prompt_rows)
                return None
            return self.decode(input_ids, positions, tables, logit_indices, prompt_rows)
        input_ids, positions, meta = self.build_inputs(batch, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[logit_indices]) if logit_indices else None
