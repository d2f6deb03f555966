"""Random weights at a real model's shape (``--load-format dummy``, vLLM's name): serve and
benchmark a model's shape without its weights. The shape comes from a Hugging Face model
directory or ``config.json``, or from a preset below; the tokenizer is ``tokenizer`` when given,
the directory's own when it has one, else the default model's. Token ids the tokenizer does not
know decode to nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# config.json of each preset: what the shape needs, as the checkpoints on the hub have it.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009]),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=131072, bos_token_id=151643, eos_token_id=151645),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=None, bos_token_id=151643,
        eos_token_id=151645),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2),
}


def dummy_config(model: str) -> tuple[dict[str, Any], Path | None]:
    """``(config.json dict, directory it came from or None)`` for a preset name, a model
    directory or a config.json file. Raises FileNotFoundError for anything else."""
    if model in PRESETS:
        return dict(PRESETS[model]), None
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file() or path.suffix != ".json":
        raise FileNotFoundError(f"--load-format dummy: {model!r} is neither a preset "
                                f"({', '.join(PRESETS)}) nor a model directory or config.json")
    return json.loads(path.read_text()), path.parent


def dummy_tokenizer(directory: Path | None, tokenizer: str | None) -> transformers.PreTrainedTokenizerFast:
    """``tokenizer`` when given, else the config directory's own tokenizer, else the default model's."""
    if tokenizer is not None:
        return transformers.AutoTokenizer.from_pretrained(Path(tokenizer).expanduser())
    if directory is not None and any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return transformers.AutoTokenizer.from_pretrained(directory)
    from vivace.models.loader import default_model_path

    gguf = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@torch.no_grad()
def randomize_(model: torch.nn.Module, device: torch.device | str, seed: int = 0, std: float = 0.02) -> None:
    """Give every parameter of ``model`` (built on the meta device) a random value on ``device``:
    normal(0, ``std``) weights and biases, norm weights 1 (as trained models roughly have), each
    drawn where it will live, so that an 8B shape never passes through host memory."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            if "norm" in module_name.rsplit(".", 1)[-1]:
                value.fill_(1.0)
            else:
                value.normal_(0.0, std, generator=generator)
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))


T = gguf.GGMLQuantizationType
# Byte offsets of each GGUF block's float16 fields (scale d, min or dmin), per type.
GGUF_HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
                    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82),
                    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ3_S: (0,)}
# |w| ~ field * (largest code and sub-block scale): float16 fields drawn at this std give weights of order 0.1.
GGUF_FIELD_STD = {T.Q8_0: 1e-3, T.Q4_0: 1e-2, T.Q5_0: 5e-3, T.Q4_1: 1e-2, T.Q5_1: 5e-3,
                  T.Q4_K: 5e-4, T.Q5_K: 2e-4, T.Q6_K: 1e-4, T.Q3_K: 1e-3, T.Q2_K: 2e-3,
                  T.IQ4_NL: 1e-3, T.IQ4_XS: 3e-5, T.IQ3_S: 2e-4}


def random_gguf_blocks(ggml_type: gguf.GGMLQuantizationType, rows: int, cols: int, device: torch.device | str,
                       seed: int = 0) -> torch.Tensor:
    """Random GGUF blocks ``uint8 [rows, row_bytes]`` of a ``rows x cols`` weight of a type of
    ``GGUF_HALF_FIELDS``, drawn on ``device``: random codes (and sub-block scales), float16 fields
    of modest size (``GGUF_FIELD_STD``), so that types no quantizer here writes can be run too."""
    generator = torch.Generator(device=device).manual_seed(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    shape = (rows, cols // block_size)
    raw = torch.randint(0, 256, (*shape, type_size), dtype=torch.uint8, device=device, generator=generator)
    for offset in GGUF_HALF_FIELDS[ggml_type]:
        half = torch.randn(*shape, 1, device=device, generator=generator) * GGUF_FIELD_STD[ggml_type]
        raw[:, :, offset:offset + 2] = half.half().view(torch.uint8)
    return raw.view(rows, -1)
