"""ModelRunner's KV cache allocation."""

import torch

from vivace.engine.runner import allocate_kv_cache


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
