"""The Llama family (Llama, Mistral without sliding window, Qwen2) over a paged KV cache.

Inputs are one flat batch: tokens of every sequence back to back, no batch dimension.
q/k/v and gate/up are each one fused Linear, so a decode step issues fewer kernels;
the loader concatenates the checkpoint's separate weights in that order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vivace.layers.attention import AttentionMetadata, DecodeMetadata, paged_attention
from vivace.layers.norm import RMSNorm
from vivace.layers.fused import apply_rotary, silu_mul
from vivace.layers.rotary import RotaryEmbedding
from vivace.models.config import ModelConfig


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache, as ``paged_attention`` expects it."""
    return (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token occupies across all layers."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_layer * config.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=config.attention_out_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split(
            [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        # q and k heads share positions, so one rotation covers both.
        qk = apply_rotary(qk.view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the stream is ``residual + x`` before this layer's
        attention (``x`` itself for the first layer), plus the attention output; the caller adds
        the MLP output, fused into the next norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names are Hugging Face's without the ``model.`` prefix, except the fused
    ``qkv_proj`` and ``gate_up_proj``; with tied embeddings there is no ``lm_head``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        # An explicit _weight skips nn.Embedding's random init: on the meta device, where the
        # loader builds the model, that init's first call costs a 1.5 s import of sympy.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata | DecodeMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm, for tokens
        ``input_ids`` at ``positions`` (both ``[num_tokens]``); writes their K/V into ``kv_caches``
        (one tensor per layer) at ``meta.slot_mapping``."""
        cos, sin = self.rotary(positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab_size]`` for hidden states ``[N, hidden_size]``."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
