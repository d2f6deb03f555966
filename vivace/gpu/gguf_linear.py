"""GGUF linear layers on the GPU: ``GgufLinear`` keeps a projection's weight as the file's bytes in
device memory, reordered into planes (``gguf_kernels.planar``: same bytes, wide loads), and
multiplies by it with ``vivace.gpu.gguf_kernels``, at batch 1 in the GEMV tiling chosen for it at
start (``gemv_config``, from ``gemv_candidates``; ``forward.choose_gemv``); ``plan_packed`` and
``pack_linears`` are the loader's side (which projections of a file stay packed, and swapping them
in); ``randomize_packed`` makes a dummy model's projections random blocks of one type (benchmarks).

A projection stays packed when its GGUF type is one the kernels read (``GPU_TYPES``): the decoder's
q/k/v, output, gate/up and down projections, and the LM head (a tied one from the embedding's
blocks, the token lookup keeping a float copy). A fused projection (q/k/v,
gate/up) stacks its parts' rows when they share one type; parts of different types (a Q4_K_M file
keeps some layers' v in Q6_K) run as a ``StackedLinear`` of one ``GgufLinear`` a type. Tensors
of other types, the embedding and norms are dequantized to float.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from vivace.gpu import kernels
from vivace.gpu.gguf_kernels import GPU_TYPES, LAYOUTS, gemv_candidates, gguf_matmul, planar
from vivace.layers.linear import StackedLinear
from vivace.models.config import ModelConfig
from vivace.models.dummy import random_gguf_blocks
from vivace.models.gguf import _hf_name, hf_rows
from vivace.models.gguf_file import GGUFFile
from vivace.models.loader import vivace_name
from vivace.models.partial_rotary import to_vivace_rows


T = gguf.GGMLQuantizationType
# The GGUF tensor that a tied LM head packs; the loader decodes it too, for the token lookup.
TIED_HEAD = "token_embd.weight"


class GgufLinear(nn.Module):
    """``y = x @ W^T + b`` for ``W`` given as GGUF blocks ``uint8 [out_features, bytes_per_row]``
    of ``ggml_type`` (one of ``GPU_TYPES``), kept as their planar rows (buffer ``blocks``, same
    shape, reordered on the blocks' device). ``x [..., in_features]`` in any float dtype; ``y``
    has its dtype. ``module.to(dtype)`` converts the bias only: the blocks stay bytes.
    ``gemv_config``: the batch-1 GEMV's tiling (None: ``gguf_kernels.default_gemv_config``)."""

    gemv_config: kernels.GemvConfig | None = None

    def __init__(self, blocks: torch.Tensor, ggml_type: gguf.GGMLQuantizationType, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if ggml_type not in LAYOUTS:
            raise ValueError(f"GGUF type {ggml_type.name} has no GPU kernel; supported: "
                             f"{', '.join(t.name for t in GPU_TYPES)}")
        layout = LAYOUTS[ggml_type]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or in_features % layout.block_cols \
                or blocks.shape[1] != in_features // layout.block_cols * layout.block_bytes:
            raise ValueError(f"{ggml_type.name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold "
                             f"rows of {in_features} weights")
        self.ggml_type = ggml_type
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", planar(blocks.contiguous(), ggml_type))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return gguf_matmul(rows, self.blocks, self.ggml_type, self.bias, self.gemv_config).view(
            *x.shape[:-1], self.out_features)

    def gemv_candidates(self) -> list[kernels.GemvConfig]:
        """The batch-1 GEMV tilings worth timing for this module's shape and type on its device
        (``gguf_kernels.gemv_candidates``), the default first."""
        return gemv_candidates(self.ggml_type, self.out_features, self.in_features, self.blocks.device)

    def weight_bytes(self) -> int:
        """Bytes of blocks (as many as the file's) and bias one forward pass reads."""
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.bias) if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.ggml_type.name}, bias={self.bias is not None}")


def plan_packed(file: GGUFFile) -> dict[str, tuple[str, ...]]:
    """vivace module name (``layers.0.self_attn.qkv_proj``, ``lm_head``) -> the GGUF tensors whose
    rows it stacks, in order, for every projection whose parts are all of types in ``GPU_TYPES``, and
    a tied LM head (no ``output.weight``) as the embedding's blocks (``TIED_HEAD``): the token
    lookup still reads a float copy, the step's largest product reads the file's bytes."""
    arch = file.metadata["general.architecture"]
    parts: dict[str, dict[int, str]] = defaultdict(dict)
    counts: dict[str, int] = {}
    for name, info in file.tensors.items():
        if len(info.shape) != 2 or not name.endswith(".weight") or name.startswith("token_embd."):
            continue
        module, index, count = vivace_name(_hf_name(name, arch))
        module = module.removesuffix(".weight")
        parts[module][index], counts[module] = name, count
    plan = {}
    for module, names in parts.items():
        if len(names) == counts[module] and all(file.tensors[name].ggml_type in GPU_TYPES for name in names.values()):
            plan[module] = tuple(names[i] for i in range(counts[module]))
    embedding = file.tensors.get(TIED_HEAD)
    if "output.weight" not in file.tensors and embedding is not None and embedding.ggml_type in GPU_TYPES:
        plan["lm_head"] = (TIED_HEAD,)  # tied: the LM head reads the embedding's blocks, the lookup a float copy
    return plan


def pack_linears(model: nn.Module, path: Path, config: ModelConfig, plan: dict[str, tuple[str, ...]]) -> None:
    """Replace each module of ``plan`` in ``model`` by a ``GgufLinear`` of its GGUF tensors' blocks
    (read from ``path``, rows in Hugging Face order, then vivace's for partial rotary), keeping the
    module's bias; parts of different types as a ``StackedLinear``, a ``GgufLinear`` for each run
    of parts of one type."""
    file = GGUFFile(path)
    arch = file.metadata["general.architecture"]
    for module_name, names in plan.items():
        runs = [list(run) for _, run in itertools.groupby((file.tensors[name] for name in names),
                                                             key=lambda info: info.ggml_type)]
        parent_name, _, child_name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        bias = None if child is None else child.bias  # None: a tied LM head
        sizes = [sum(info.shape[0] for info in run) for run in runs]
        biases = [None] * len(runs) if bias is None else bias.split(sizes)
        packed = []
        for run, run_bias in zip(runs, biases):
            blocks = np.concatenate([to_vivace_rows(_hf_name(info.name, arch),
                                                    hf_rows(file.blocks(info), info.name, config), config)
                                     for info in run])
            packed.append(GgufLinear(torch.from_numpy(blocks), run[0].ggml_type, run[0].shape[1], run_bias))
        setattr(parent, child_name, packed[0] if len(packed) == 1 else StackedLinear(packed))


# llama-quantize's Q4_K_M, a mix ``randomize_packed`` draws: Q4_K, but Q6_K for the LM head and,
# in the layers ``_more_bits`` picks, for v and the down projection.
Q4_K_M = "Q4_K_M"


def _more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of layers whose v and down projections get more bits: the first
    and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def randomize_packed(model: nn.Module, weight_format: gguf.GGMLQuantizationType | str, seed: int = 0) -> None:
    """Replace every projection of ``model`` (q/k/v, output, gate/up, down, the LM head) by a
    ``GgufLinear`` of random blocks on the device of its weight, biases kept: a dummy model at a
    real shape in a GGUF format, for benchmarks. ``weight_format``: a GGUF type (or its name), or
    ``Q4_K_M``, llama-quantize's mix (v of a Q6_K layer apart from q/k: a ``StackedLinear``, as a
    real file loads). A tied LM head gets blocks of its own, as a tied GGUF's is packed
    (``plan_packed``); the embedding stays float for the lookup."""
    mix = weight_format == Q4_K_M
    base = T.Q4_K if mix else weight_format if isinstance(weight_format, T) else T[weight_format]
    layers = len(getattr(model, "layers", ()))

    def packed(rows: int, columns: int, ggml_type: T, device: torch.device, bias: torch.Tensor | None = None
               ) -> GgufLinear:
        nonlocal seed
        seed += 1
        return GgufLinear(random_gguf_blocks(ggml_type, rows, columns, device, seed - 1), ggml_type, columns, bias)

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            (rows, columns), device = child.weight.shape, child.weight.device
            parts = name.split(".")
            more = mix and parts[0] == "layers" and _more_bits(int(parts[1]), layers)
            if more and child_name == "qkv_proj":
                v_rows = model.config.num_key_value_heads * model.config.head_dim
                biases = (None, None) if child.bias is None else child.bias.split([rows - v_rows, v_rows])
                replacement = StackedLinear([packed(rows - v_rows, columns, base, device, biases[0]),
                                             packed(v_rows, columns, T.Q6_K, device, biases[1])])
            else:
                six_bits = mix and (child_name == "lm_head" or (more and child_name == "down_proj"))
                ggml_type = T.Q6_K if six_bits else base
                replacement = packed(rows, columns, ggml_type, device, child.bias)
            setattr(module, child_name, replacement)
    if getattr(model, "lm_head", True) is None:
        vocab, hidden = model.embed_tokens.weight.shape
        model.lm_head = packed(vocab, hidden, T.Q6_K if mix else base, model.embed_tokens.weight.device)
