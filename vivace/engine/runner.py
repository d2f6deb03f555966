"""Host-side batch building and the model forward: one flat batch per step."""

from __future__ import annotations

import torch

from vivace.engine.kv_cache import KVCacheManager
from vivace.engine.scheduler import ScheduledBatch
from vivace.layers.attention import AttentionMetadata
from vivace.models import LoadedModel
from vivace.models.llama import kv_cache_shape


def num_blocks_for_budget(loaded: LoadedModel, block_size: int, dtype: torch.dtype, memory_gb: float) -> int:
    per_block = 2 * loaded.config.num_hidden_layers * block_size * loaded.config.num_key_value_heads
    per_block *= loaded.config.head_dim * torch.empty((), dtype=dtype).element_size()
    return max(int(memory_gb * (1 << 30)) // per_block, 1)


class ModelRunner:
    """Owns the KV tensors and turns a scheduled batch into logits."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.model = loaded.model
        self.block_size = block_size
        shape = kv_cache_shape(loaded.config, num_blocks, block_size)
        # Zeroed, so padding never meets NaN garbage from uninitialized memory.
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(loaded.config.num_hidden_layers)]

    def build_inputs(self, batch: ScheduledBatch, kv: KVCacheManager) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            end = start + num_new
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
        )
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def execute(self, batch: ScheduledBatch, kv: KVCacheManager, logit_indices: list[int]) -> torch.Tensor | None:
        """Run the batch (writing its K/V); return float32 logits ``[len(logit_indices), vocab]``
        at those flat token indices, or None when no logits are wanted this step."""
        input_ids, positions, meta = self.build_inputs(batch, kv)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[logit_indices]) if logit_indices else None
