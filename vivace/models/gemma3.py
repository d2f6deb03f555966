"""Gemma 3 (text): the Llama-family model of ``vivace.models.llama`` with Gemma's differences,
all of them here:

- RMSNorm scales by ``1 + w``: the loader adds the 1 to every norm weight once
  (``convert_checkpoint_tensor``), so the shared RMSNorm applies it;
- a norm after attention and another around the MLP (pre- and post-feedforward), besides the
  input norm;
- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weights' dtype, as transformers does);
- a GELU (tanh approximation) gated MLP;
- attention scaled by ``query_pre_attn_scalar ** -0.5``, per-head q/k norms, and interleaved
  sliding-window and global layers with their own rope bases (``ModelConfig`` carries those).
"""

from __future__ import annotations

import torch
from torch import nn

from vivace.layers.attention import AttentionMetadata, DecodeMetadata
from vivace.layers.fused import gelu_tanh_mul
from vivace.layers.norm import RMSNorm
from vivace.models.config import ModelConfig
from vivace.models.llama import MLP, Attention, LlamaForCausalLM, Rope


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
         self.post_feedforward_layernorm) = (RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) for _ in range(4))
        self.self_attn = Attention(config, layer, dtype)
        self.mlp = GeluMLP(config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``llama.DecoderLayer.forward``: ``(post-feedforward-normed MLP output, residual stream)``."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device="cpu"))

    @staticmethod
    def convert_checkpoint_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """Norm weights ``w`` become ``1 + w`` (in float32, before any cast)."""
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
