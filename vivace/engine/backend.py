"""The device seam: what ``--device`` changes in an engine, and nothing else.

A backend loads the weights where they run, sizes the KV pool, and makes the runner (the object
with ``execute``, ``clear_blocks`` and ``compiled_rows``); the scheduler, KV block manager,
prefix cache, sampler and server above it are the same for every device. ``cpu`` is
``vivace.engine.runner``; ``cuda`` is ``vivace.gpu`` (Triton kernels, KV in device memory,
CUDA graphs per decode batch bucket).
"""

from __future__ import annotations

import logging

from vivace.config import EngineConfig, check_quantization, resolve_device
from vivace.engine.runner import ModelRunner, num_blocks_for_budget
from vivace.layers.packed_linear import prepack_linears
from vivace.models import LoadedModel, load_model

logger = logging.getLogger(__name__)


def load(config: EngineConfig) -> LoadedModel:
    """The engine's model, on its device, ready for its runner."""
    device = resolve_device(config.device)
    if device != "cpu" and config.speculative and config.speculative.startswith("draft:"):
        raise ValueError(f"--speculative draft:<model> runs on CPU only; on {device} use ngram")
    check_quantization(config.quantization, device)
    loaded = load_model(config.model, config.torch_dtype, config.quantization, config.load_format,
                        config.tokenizer, device, max_model_len=config.max_model_len)
    prepare(loaded, device)
    return loaded


def prepare(loaded: LoadedModel, device: str) -> None:
    """Device-specific weight layout: on CPU, linear layers repacked for the native GEMM; on
    another device, the weights moved there (when they were loaded elsewhere)."""
    if device == "cpu":
        prepack_linears(loaded.model)
    else:
        loaded.model.to(device)


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> int:
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if resolve_device(config.device) == "cuda" and config.kv_cache_memory_gb is None:
        from vivace.gpu.memory import gpu_kv_blocks

        return gpu_kv_blocks(loaded, config, max_model_len)
    return num_blocks_for_budget(loaded, config.block_size, config.kv_torch_dtype, config.kv_cache_memory_gb,
                                 max_model_len)


def make_runner(config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int,
                loaded_from_config: bool = False):
    """The runner of ``config.device``; logs the KV pool it holds. A CPU runner compiles its decode
    graph in the background when ``config.background_compile`` asks and ``loaded`` is what
    ``config`` loads (``loaded_from_config``), which the compiling child process loads again."""
    device = resolve_device(config.device)
    logger.info("KV cache: %d blocks, %d tokens, %s (%s)", num_blocks, num_blocks * config.block_size,
                str(config.kv_torch_dtype).removeprefix("torch."), device)
    if device == "cuda":
        from vivace.gpu.runner import PREFILL_GRAPH_MAX_TOKENS, CudaRunner

        graphs = 0 if config.enforce_eager else min(config.cuda_graph_max_batch, config.max_num_seqs)
        return CudaRunner(loaded, num_blocks, config.block_size, config.kv_torch_dtype, max_model_len,
                          device="cuda", cuda_graph_max_batch=graphs, max_num_seqs=config.max_num_seqs,
                          seed=config.seed, verify_batch=config.speculative_max_batch if config.speculative else 0,
                          verify_tokens=config.num_speculative_tokens if config.speculative else 0,
                          prefill_graph_tokens=0 if config.enforce_eager else min(config.max_num_batched_tokens,
                                                                                  PREFILL_GRAPH_MAX_TOKENS))
    background = config if config.background_compile and loaded_from_config else None
    return ModelRunner(loaded, num_blocks, config.block_size, config.kv_torch_dtype, max_model_len,
                       config.max_num_seqs if config.compile else 0, background, config.batch_invariant)
