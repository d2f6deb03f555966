"""Weight-only quantization of a loaded Llama-family model.

Every decoder projection becomes a ``QuantizedLinear`` of the chosen mode; the logits
projection (``lm_head``, or a quantized copy of the tied embedding) becomes int8 in both
modes, as llama.cpp keeps it, because it is the layer most sensitive to quantization.
From a GGUF file, tensors already stored as Q8_0 (int8) or Q4_0/Q4_1 (int4) are taken
code for code, with no requantization; any other tensor is quantized from its float value.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from vivace.layers.linear import QuantizedLinear
from vivace.layers.quant_format import QuantizedWeight, from_gguf_blocks
from vivace.models.gguf import _hf_name, _unpermute
from vivace.models.gguf_file import GGUFFile
from vivace.models.llama import LlamaForCausalLM

QUANTIZATIONS = ("none", "int8", "int4")
_DIRECT_TYPES = {
    "int8": {gguf.GGMLQuantizationType.Q8_0},
    "int4": {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1},
}
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantize_model(model: LlamaForCausalLM, mode: str, gguf_path: Path | None = None) -> LlamaForCausalLM:
    """Swap ``model``'s linear layers for ``mode`` ("int8" or "int4") quantized ones, in place.

    ``gguf_path`` is the file the model was loaded from, if any: its Q8_0/Q4_x tensors are
    used directly. Returns ``model``; raises ValueError for an unknown mode.
    """
    if mode not in QUANTIZATIONS[1:]:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    stored = _gguf_weights(gguf_path, model, mode) if gguf_path is not None else {}
    for index, layer in enumerate(model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    hf_prefix = f"model.layers.{index}.{'self_attn' if parent is layer.self_attn else 'mlp'}"
                    direct = _fused_weight(stored, hf_prefix, name)
                    setattr(parent, name, _quantized(child.weight, child.bias, mode, direct))
    logits_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    direct = stored.get("lm_head.weight", stored.get("model.embed_tokens.weight"))
    model.lm_head = _quantized(logits_weight, None, "int8", direct)
    return model


def native_quantization(gguf_path: Path) -> str:
    """The mode that runs a GGUF file's decoder projections in their own format: "int8" when
    most are Q8_0, "int4" when most are Q4_0/Q4_1, else "none" (float or K-quants, which
    vivace would have to requantize)."""
    counts = dict.fromkeys(QUANTIZATIONS, 0)
    for name, info in GGUFFile(gguf_path).tensors.items():
        if name.startswith("blk.") and name.endswith(".weight") and len(info.shape) == 2:
            mode = next((m for m, types in _DIRECT_TYPES.items() if info.ggml_type in types), "none")
            counts[mode] += 1
    return max(counts, key=counts.get)  # "none" comes first, so it wins ties and empty files


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
               direct: QuantizedWeight | None) -> QuantizedLinear:
    if direct is not None and direct.codes.shape == weight.shape:
        return QuantizedLinear(direct, bias)
    return QuantizedLinear.from_float(weight, bias, mode)  # type: ignore[arg-type]


def _fused_weight(stored: dict[str, QuantizedWeight], prefix: str, name: str) -> QuantizedWeight | None:
    """The stored weight of ``prefix.name``, rows of fused parts concatenated when all share a format."""
    parts = [stored.get(f"{prefix}.{part}.weight") for part in _FUSED_PARTS.get(name, (name,))]
    if any(part is None for part in parts):
        return None
    first = parts[0]
    if any((p.bits, p.group_size, p.zero_point, p.mins is None)
           != (first.bits, first.group_size, first.zero_point, first.mins is None) for p in parts):
        return None
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins,
                           first.zero_point, first.bits, first.group_size)


def _gguf_weights(path: Path, model: LlamaForCausalLM, mode: str) -> dict[str, QuantizedWeight]:
    """HF name -> quantized weight for every GGUF tensor stored in a format ``mode`` takes directly
    (the logits projection: Q8_0 in either mode)."""
    file = GGUFFile(path)
    config = model.config
    rotary_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    permuted = config.architecture == "LlamaForCausalLM"  # as vivace.models.gguf undoes on load
    weights = {}
    for name, info in file.tensors.items():
        logits = name in ("output.weight", "token_embd.weight")
        accepted = _DIRECT_TYPES["int8" if logits else mode]
        if info.ggml_type not in accepted or not name.endswith(".weight"):
            continue
        weight = from_gguf_blocks(file.blocks(info), info.ggml_type)
        part = name.split(".")[-2]
        if permuted and part in rotary_heads:
            weight = _unpermute_rows(weight, rotary_heads[part])
        weights[_hf_name(name)] = weight
    return weights


def _unpermute_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(_unpermute(t.numpy(), num_heads)))

    mins = None if weight.mins is None else rows(weight.mins)
    return QuantizedWeight(rows(weight.codes), rows(weight.scales), mins,
                           weight.zero_point, weight.bits, weight.group_size)
