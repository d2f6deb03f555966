"""Sizing the device KV pool by ``--gpu-memory-utilization`` (vLLM's meaning: weights,
activations and KV together take that share of the GPU's memory; KV gets the rest)."""

from __future__ import annotations

import torch

from vivace.config import EngineConfig
from vivace.gpu.sampler import workspace_bytes
from vivace.models import LoadedModel
from vivace.models.llama import kv_bytes_per_token

GRAPH_RESERVE = 1 << 30  # CUDA graph pools, cuBLAS workspaces, Triton's and the allocator's slack


def activation_bytes(loaded: LoadedModel, config: EngineConfig) -> int:
    """An upper bound of the largest step's transient memory: the widest per-token tensors of one
    layer for ``max_num_batched_tokens`` tokens, plus the logits of every sequence in float32."""
    c = loaded.config
    itemsize = config.torch_dtype.itemsize
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    per_token = (4 * c.hidden_size + qkv + c.num_attention_heads * c.head_dim + 3 * c.intermediate_size) * itemsize
    logits = min(config.max_num_seqs, config.max_num_batched_tokens) * c.vocab_size * (itemsize + 4) * 2
    return config.max_num_batched_tokens * per_token + logits


def gpu_kv_blocks(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """KV blocks that fit in the share of GPU memory left after the weights (already on the device),
    the largest step and the device sampler. Raises ValueError naming the flags when not even one ``max_model_len``
    sequence fits."""
    free, total = torch.cuda.mem_get_info()
    used = total - free
    step = activation_bytes(loaded, config) + workspace_bytes(config.max_num_seqs, loaded.config.vocab_size,
                                                               max_model_len)
    budget = int(total * config.gpu_memory_utilization) - used - step - GRAPH_RESERVE
    per_block = kv_bytes_per_token(loaded.config, config.kv_torch_dtype) * config.block_size
    blocks = max(budget, 0) // per_block
    need = -(-max_model_len // config.block_size)
    if blocks < need:
        raise ValueError(
            f"too little GPU memory for the KV cache: {max(budget, 0) / 2**30:.2f} GiB is left of "
            f"--gpu-memory-utilization {config.gpu_memory_utilization} x {total / 2**30:.1f} GiB after the weights and "
            f"activations ({used / 2**30:.1f} GiB in use), {need} blocks are needed for one --max-model-len "
            f"{max_model_len} sequence: raise --gpu-memory-utilization or lower --max-model-len")
    return blocks
