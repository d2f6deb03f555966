"""Weight-only quantization of a loaded model.

"int8" and "int4": every decoder projection (in a mixture of experts, each expert's; the router
stays float) becomes a ``QuantizedLinear`` of that mode; from a GGUF file, tensors already stored
as Q8_0 (int8) or Q4_0/Q4_1 (int4) are taken code for code, any other tensor is quantized from its
float value. "gguf" (what ``--quantization auto`` picks
for a quantized GGUF): every projection in the file's own format, as llama.cpp runs it, through
``vivace.layers.gguf_blocks`` (Q8_0, Q4_0/1, Q5_0/1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and
IQ4_NL/IQ4_XS as 4-bit codes into their table); a float tensor stays float, and a type without a
native form (the other IQ*, TQ*) runs as Q8_0 of its dequantized values, with a warning that says
so. In every mode the logits projection (``lm_head``, or a quantized copy of the tied embedding)
keeps at least 6-bit codes, as llama.cpp does, because it is the layer most sensitive to
quantization: the file's own tensor when it is stored in a form of 6 or 8 bits (Q8_0, Q6_K as
llama.cpp's Q4_K_M and IQ4_XS files keep it), else int8 (an IQ4 head too). A mixture's experts
taken code for code need no float value at all: ``experts_taken_as_stored`` names them, and the
loader leaves them undecoded.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from vivace.layers.gguf_blocks import NATIVE_TYPES, from_gguf_blocks
from vivace.layers.linear import QuantizedLinear, StackedLinear
from vivace.layers.quant_format import QuantizedWeight
from vivace.models.gguf import _hf_name, hf_rows
from vivace.models.gguf_file import GGUFFile, dequantize_blocks
from vivace.models.llama import LlamaForCausalLM
from vivace.models.moe import SparseMoeBlock, expert_name
from vivace.models.partial_rotary import to_vivace_rows

QUANTIZATIONS = ("none", "int8", "int4", "gguf")
T = gguf.GGMLQuantizationType
_DIRECT_TYPES = {"int8": {T.Q8_0}, "int4": {T.Q4_0, T.Q4_1}, "gguf": set(NATIVE_TYPES)}
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
Reader = Callable[[], QuantizedWeight]

logger = logging.getLogger(__name__)


def quantize_model(model: LlamaForCausalLM, mode: str, gguf_path: Path | None = None) -> LlamaForCausalLM:
    """Swap ``model``'s linear layers for ``mode`` quantized ones, in place (module docstring).

    ``gguf_path`` is the file the model was loaded from, if any (required for "gguf").
    Returns ``model``; raises ValueError for an unknown mode.
    """
    if mode not in QUANTIZATIONS[1:] or (mode == "gguf" and gguf_path is None):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} ('gguf' for a GGUF file), got {mode!r}")
    stored = _gguf_weights(gguf_path, model, mode) if gguf_path is not None else {}
    for index, layer in enumerate(model.layers):
        for hf_prefix, parent in _projection_owners(layer, f"model.layers.{index}"):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    direct = _fused_weight(stored, hf_prefix, name)
                    if direct is not None or mode != "gguf":
                        setattr(parent, name, _quantized(child.weight, child.bias, mode, direct))
    tied = model.lm_head is None
    logits_weight = model.embed_tokens.weight if tied else model.lm_head.weight
    read = stored.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    direct = None if read is None else read()
    runs = [direct] if direct is not None and direct.bits >= 6 else None
    model.lm_head = _quantized(logits_weight, None, "int8", runs)
    return model


def _projection_owners(layer: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """``(HF name, module)`` of each module of ``layer`` whose linear children are its projections:
    attention, and the MLP or, in a mixture of experts, each expert (not the router, which stays float)."""
    owners = [(f"{prefix}.self_attn", layer.self_attn)]
    if isinstance(layer.mlp, SparseMoeBlock):
        return owners + [(f"{prefix}.mlp.experts.{e}", expert) for e, expert in enumerate(layer.mlp.experts)]
    return owners + [(f"{prefix}.mlp", layer.mlp)]


def experts_taken_as_stored(gguf_path: Path, mode: str) -> set[str]:
    """The GGUF expert tensors (``ffn_*_exps``) that ``quantize_model`` in ``mode`` takes code for
    code, which the loader need not dequantize (a 30B mixture's experts would take 120 GB as
    float32): a down projection of a type ``mode`` takes, gate and up when both are of such types."""
    if mode not in _DIRECT_TYPES:
        return set()
    tensors = GGUFFile(gguf_path).tensors
    taken = set()
    for name, info in tensors.items():
        if info.ggml_type not in _DIRECT_TYPES[mode]:
            continue
        if name.endswith(".ffn_down_exps.weight"):
            taken.add(name)
        up = tensors.get(name.replace(".ffn_gate_exps.", ".ffn_up_exps."))
        if name.endswith(".ffn_gate_exps.weight") and up is not None and up.ggml_type in _DIRECT_TYPES[mode]:
            taken |= {name, up.name}
    return taken


def native_quantization(gguf_path: Path) -> str:
    """The mode that runs a GGUF file's decoder projections in their own format: "gguf" when
    most are quantized, else "none" (a float file)."""
    counts = Counter(info.ggml_type in _FLOAT_TYPES for name, info in GGUFFile(gguf_path).tensors.items()
                     if name.startswith("blk.") and name.endswith(".weight") and len(info.shape) in (2, 3))
    return "gguf" if counts[False] > counts[True] else "none"


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
               direct: list[QuantizedWeight] | None) -> QuantizedLinear | StackedLinear:
    """The layer of float ``weight`` (and ``bias``): ``direct``'s runs of stored rows as they
    are when they cover it, else ``weight`` quantized in ``mode`` (int8 for "gguf")."""
    rows = None if direct is None else [run.codes.shape for run in direct]
    if rows is None or sum(n for n, _ in rows) != weight.shape[0] or any(k != weight.shape[1] for _, k in rows):
        return QuantizedLinear.from_float(weight, bias, "int8" if mode == "gguf" else mode)  # type: ignore[arg-type]
    if len(direct) == 1:
        return QuantizedLinear(direct[0], bias)
    biases = [None] * len(direct) if bias is None else bias.split([n for n, _ in rows])
    return StackedLinear([QuantizedLinear(run, b) for run, b in zip(direct, biases)])


def _fused_weight(stored: dict[str, Reader], prefix: str, name: str) -> list[QuantizedWeight] | None:
    """The stored weight of ``prefix.name`` as runs of rows: fused parts of one format
    concatenated into one run, a part of another format in a run of its own (a Q4_K_M file keeps
    some layers' v projection in Q6_K: their q and k run as one Q4_K weight and v apart, each
    read in its own format rather than all three widened to 8 bits)."""
    if f"{prefix}.{name}.weight" in stored:  # stored fused (Phi-3)
        return [stored[f"{prefix}.{name}.weight"]()]
    readers = [stored.get(f"{prefix}.{part}.weight") for part in _FUSED_PARTS.get(name, (name,))]
    if any(read is None for read in readers):
        return None
    runs: list[list[QuantizedWeight]] = []
    for part in (read() for read in readers):
        if runs and _form(runs[-1][0]) == _form(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return [_stacked(run) for run in runs]


def _stacked(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one form, rows of each in turn."""
    first = parts[0]
    if len(parts) == 1:
        return first

    def cat(field: str) -> torch.Tensor | None:
        return None if getattr(first, field) is None else torch.cat([getattr(p, field) for p in parts])

    return replace(first, codes=cat("codes"), scales=cat("scales"), mins=cat("mins"), sub_scales=cat("sub_scales"),
                   sub_mins=cat("sub_mins"))


def _form(weight: QuantizedWeight) -> tuple[object, ...]:
    """What weights must share to be stacked row on row (IQ4_NL and IQ4_XS share one: their table)."""
    codebook = None if weight.codebook is None else tuple(weight.codebook.tolist())
    return weight.bits, weight.group_size, weight.zero_point, weight.mins is None, weight.sub_group, codebook


def _gguf_weights(path: Path, model: LlamaForCausalLM, mode: str) -> dict[str, Reader]:
    """HF name -> the reader of its quantized weight for every GGUF tensor stored in a format
    ``mode`` takes directly (the logits projection: a form of 6 or 8 bits, or Q8_0 outside "gguf"
    mode). A weight is decoded when read, so that only the layer being swapped holds its decoded
    codes (a byte a weight: all experts of a 30B mixture at once would take some 30 GB)."""
    file = GGUFFile(path)
    arch = file.metadata["general.architecture"]
    weights, fallback = {}, Counter()
    for name, info in file.tensors.items():
        logits = name in ("output.weight", "token_embd.weight")
        accepted = _DIRECT_TYPES["int8" if logits and mode != "gguf" else mode]
        if not name.endswith(".weight") or len(info.shape) not in (2, 3):
            continue
        if info.ggml_type not in accepted:
            if mode != "gguf" or info.ggml_type in _FLOAT_TYPES:
                continue
            fallback[info.ggml_type.name] += 1  # read as Q8_0 (_decoded)
        hf_name = _hf_name(name, arch)
        if len(info.shape) == 3:  # a mixture's experts, one matrix each
            blocks = file.blocks(info)
            weights.update((expert_name(hf_name, e), functools.partial(_decoded, blocks[e], info.ggml_type))
                           for e in range(info.shape[0]))
            continue
        # Rows as the float model holds them: llama.cpp's order undone, then vivace's (partial rotary).
        rows = np.arange(info.shape[0])
        order = to_vivace_rows(hf_name, hf_rows(rows, name, model.config), model.config)
        weights[hf_name] = functools.partial(_read_rows, file.blocks(info), info.ggml_type,
                                             None if np.array_equal(order, rows) else order)
    if fallback:
        logger.warning("vivace: GGUF types without a native kernel run as 8-bit codes, their dequantized values "
                       "quantized again as Q8_0 (8.5 bits a weight): %s (native: %s)",
                       ", ".join(f"{t} ({n} tensors)" for t, n in sorted(fallback.items())),
                       ", ".join(t.name for t in NATIVE_TYPES))
    return weights


def _decoded(blocks: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """``blocks`` as the native kernels read them: in their own form where ``from_gguf_blocks``
    has one, else their dequantized values quantized again as Q8_0. That costs a second rounding
    (Q8_0's, ~0.4% of a weight against the coarser type's own) and more bytes than the file's,
    but a quarter of the float32 weight the type would otherwise run as."""
    if ggml_type in NATIVE_TYPES:
        return from_gguf_blocks(blocks, ggml_type)
    values = dequantize_blocks(np.asarray(blocks), ggml_type)
    return from_gguf_blocks(gguf.quants.quantize(values, T.Q8_0), T.Q8_0)


def _read_rows(blocks: np.ndarray, ggml_type: gguf.GGMLQuantizationType,
               order: np.ndarray | None) -> QuantizedWeight:
    weight = _decoded(blocks, ggml_type)
    return weight if order is None else _take_rows(weight, order)


def _take_rows(weight: QuantizedWeight, order: np.ndarray) -> QuantizedWeight:
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[torch.from_numpy(order)]

    mins, sub_scales, sub_mins = (None if t is None else rows(t) for t in (weight.mins, weight.sub_scales,
                                                                           weight.sub_mins))
    return replace(weight, codes=rows(weight.codes), scales=rows(weight.scales), mins=mins, sub_scales=sub_scales,
                   sub_mins=sub_mins)
