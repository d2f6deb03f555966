"""FP8 linear layers on the GPU (``--quantization fp8``): ``Fp8Linear`` holds a projection's weight
as ``float8_e4m3fn`` with one float32 scale per output channel and multiplies by it with
``vivace.gpu.fp8_kernels``; ``install_fp8`` is the loader's side: it swaps in the weights an FP8
checkpoint stores (``vivace.models.fp8``) and, for ``--quantization fp8``, quantizes every other
decoder projection (q/k/v, output, gate/up, down) from its float weight, on the device.

The LM head stays in the model's dtype, as vLLM and FP8 checkpoints (``ignore: [lm_head]``) keep it
and as the CPU's int8/int4 modes keep it at 8 bits: it is the layer most sensitive to
quantization, and e4m3 has 3 mantissa bits. On the default model (SmolLM2-135M), an e4m3 LM head
alone added about 2% to the perplexity of benchmarks/perplexity.py's text, as much as every other
projection together.

For the same reason the first and the last decoder layers stay in the model's dtype when a model
is quantized at load and has ``FLOAT_ENDS_MIN_LAYERS`` layers or more (at most a quarter of its
layers), as llama.cpp's K-quant mixes give more bits to the first and last layers' tensors. On the
default model (30 layers), simulated in float32 with per-token FP8 activations as the prefill's
GEMM quantizes them: every decoder projection in FP8 added 2.4% to the perplexity of
tests/data/quant_text.txt and 3.1% on tests/data/moby_dick_loomings.txt; with the last layer in
float 0.5% and 1.7%; with the first and the last 1.3% and 1.2% (quantized alone, the last layer's
projections cost 1.4 of the 2.2 points that weight-only FP8 costs there). The price is bytes: 2 of
32 layers at twice the bytes read 6% more per token on the Llama-3.1-8B shape. An FP8 checkpoint
is loaded as it is stored.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from vivace.gpu.fp8_kernels import FP8, fp8_matmul, gemv_candidates, quantize_weight
from vivace.gpu.gguf_kernels import num_sms
from vivace.gpu.kernels import GemvConfig
from vivace.models.loader import vivace_name


FLOAT_ENDS_MIN_LAYERS = 8  # from this many decoder layers, the first and the last stay in float


def float_layers(num_layers: int) -> set[int]:
    """Indices of the decoder layers ``--quantization fp8`` leaves in the model's dtype."""
    return {0, num_layers - 1} if num_layers >= FLOAT_ENDS_MIN_LAYERS else set()


class Fp8Linear(nn.Module):
    """``y = (x @ W^T) * scale + b`` for ``W`` ``float8_e4m3fn [out_features, in_features]`` and
    ``scale`` float32 ``[out_features]``. ``x [..., in_features]`` in any float dtype; ``y`` has its
    dtype. Move it with ``.to(device)`` only: ``.to(dtype)`` would convert the codes too.
    ``gemv_config`` tiles the GEMV of up to ``GEMV_MAX_ROWS`` rows (None: the launcher's default);
    ``forward.choose_gemv`` sets it from ``gemv_candidates()`` by timing."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2 or scale.shape != weight.shape[:1]:
            raise ValueError(f"FP8 weight {tuple(weight.shape)} {weight.dtype} with scales {tuple(scale.shape)}: "
                             f"expected float8_e4m3fn [out, in] and one scale per output row")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.gemv_config: GemvConfig | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        """The layer of float ``weight [out, in]`` quantized per output row, where it lives."""
        return cls(*quantize_weight(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = fp8_matmul(rows, self.weight, self.scale, self.bias, self.gemv_config)
        return out.view(*x.shape[:-1], self.out_features)

    def gemv_candidates(self) -> list[GemvConfig]:
        """The GEMV tilings worth timing for this layer's shape on its device, the default first."""
        return gemv_candidates(self.out_features, self.in_features, num_sms(self.weight.device))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``W * scale`` this layer multiplies by."""
        return self.weight.float() * self.scale[:, None]

    def weight_bytes(self) -> int:
        """Bytes of codes, scales and bias one forward pass reads."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.bias) if t is not None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def install_fp8(model: nn.Module, stored: dict[str, tuple[torch.Tensor, torch.Tensor]], quantize_float: bool,
                device: str) -> None:
    """Make ``model``'s projections ``Fp8Linear`` on ``device``: those of ``stored`` (Hugging Face
    weight name -> ``(codes, scale [out])``, as ``vivace.models.fp8.read_fp8`` kept them; q/k/v and
    gate/up parts stacked in order) as they are; with ``quantize_float``, every other decoder
    projection quantized from its float weight but those of ``float_layers``. Raises ValueError
    for a stored weight that is not a linear layer of ``model``."""
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    for hf_name, codes_and_scale in stored.items():
        name, index, _ = vivace_name(hf_name)
        parts[name.removesuffix(".weight")][index] = codes_and_scale
    for name, by_index in parts.items():
        parent, child_name, child = _child(model, name)
        codes = torch.cat([by_index[i][0] for i in sorted(by_index)]).to(device)
        scale = torch.cat([by_index[i][1] for i in sorted(by_index)]).to(device)
        bias = None if child.bias is None else child.bias.to(device)
        setattr(parent, child_name, Fp8Linear(codes, scale, bias))
    if quantize_float:
        kept = float_layers(len(model.layers))
        for index, layer in enumerate(model.layers):
            if index not in kept:
                _quantize_linears(layer, device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the float weights' transient copies: KV sizing counts what is reserved


def _child(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Linear]:
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    child = getattr(parent, child_name, None)
    if not isinstance(child, nn.Linear):
        raise ValueError(f"the checkpoint stores {name} in FP8, but it is not a linear layer of this model")
    return parent, child_name, child


def _quantize_linears(layer: nn.Module, device: str) -> None:
    """Every float ``nn.Linear`` inside ``layer`` becomes an ``Fp8Linear`` on ``device``."""
    for module in list(layer.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                bias = None if child.bias is None else child.bias.to(device)
                setattr(module, child_name, Fp8Linear.from_float(child.weight.to(device), bias))
