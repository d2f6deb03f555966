"""ModelRunner's KV cache allocation."""

import os

import torch

from vivace.engine.runner import (
    DEFAULT_POOL_MEMORY_SHARE, DEFAULT_POOL_SEQUENCES, allocate_kv_cache, kv_bytes_per_token, num_blocks_for_budget)
from vivace.models import load_model


def resident_kb() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])


def test_kv_cache_reads_zeros_and_costs_no_memory_until_written():
    before = resident_kb()
    cache = allocate_kv_cache((2, 4096, 16, 4, 64), torch.float32)  # 128 MiB
    assert resident_kb() - before < 16 * 1024
    assert cache.shape == (2, 4096, 16, 4, 64) and not cache[:, ::64].any()
    cache[1, 7] = 1.0
    assert cache.sum() == 16 * 4 * 64


def test_the_default_pool_holds_sixteen_long_sequences_within_a_share_of_memory(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), torch.float32)
    per_token = kv_bytes_per_token(loaded, torch.float32)
    c = loaded.config
    assert per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    blocks = num_blocks_for_budget(loaded, 16, torch.float32, None, max_model_len=1024)
    assert blocks == min(DEFAULT_POOL_SEQUENCES * 1024 // 16, int(memory * DEFAULT_POOL_MEMORY_SHARE) // (16 * per_token))
    # A context too long for the share still gets one whole sequence.
    huge = int(memory // per_token)
    assert num_blocks_for_budget(loaded, 16, torch.float32, None, max_model_len=huge) == -(-huge // 16)
    # A budget is a budget.
    assert num_blocks_for_budget(loaded, 16, torch.float32, 0.001, 1024) == (1 << 30) // 1000 // (16 * per_token)
