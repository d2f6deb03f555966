"""The Llama family (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite) over a paged KV cache.

Inputs are one flat batch: tokens of every sequence back to back, no batch dimension.
q/k/v and gate/up are each one fused Linear, so a decode step issues fewer kernels;
the loader concatenates the checkpoint's separate weights in that order (Phi-3 ships them fused).
What sets the members apart, all read from ``ModelConfig``: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), sliding-window layers (Mistral, Phi-3, Qwen2/3 with ``use_sliding_window``),
partial rotary (Phi-4-mini: q/k head dims reordered at load, ``vivace.models.partial_rotary``),
layers without rotary (SmolLM3's NoPE layers rotate by an identity table: cos 1, sin 0), queries
scaled by position (Ministral 3's Llama 4 temperature), Granite's multipliers (the residual stream
carried divided by ``residual_multiplier`` so the blocks add their outputs unscaled, embeddings
scaled at ``embed``, the attention scale, logits scaled through the final norm's weight; see
``ModelConfig``).
Gemma 3 (``vivace.models.gemma3``) and the mixtures of experts (``vivace.models.moe``: Qwen3-MoE,
Mixtral) build on the attention and model classes here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vivace.layers.attention import AttentionMetadata, DecodeMetadata, paged_attention
from vivace.layers.fused import apply_rotary, silu_mul
from vivace.layers.norm import RMSNorm
from vivace.layers.rotary import RotaryEmbedding, query_temperature
from vivace.models.config import FULL, NOPE, SLIDING, ModelConfig

# rope type (FULL, SLIDING, NOPE) -> (cos, sin) of this batch's positions; QUERY_SCALE -> (the
# factor ``[num_tokens, 1, 1]`` the rotated queries are multiplied by,) for a model that scales them.
Rope = dict[str, tuple[torch.Tensor, ...]]
QUERY_SCALE = "query_scale"


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's KV cache, as ``paged_attention`` expects it."""
    return (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token occupies across all layers."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_layer * config.num_hidden_layers


class Attention(nn.Module):
    """Attention of layer ``layer``: windowed when the config makes it a sliding layer, rotating
    with the table ``ModelConfig.rope_type`` names (the identity for a NoPE layer)."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.window(layer)
        self.rope_type = config.rope_type(layer)
        self.scales_queries = config.query_temperature is not None
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=config.attention_out_bias, dtype=dtype)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata | DecodeMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        cos, sin = rope[self.rope_type]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.q_norm is None:
            qk, v = self.qkv_proj(x).split([q_size + kv_size, kv_size], dim=-1)
            # q and k heads share positions, so one rotation covers both.
            qk = apply_rotary(qk.view(num_tokens, -1, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1, self.head_dim), cos, sin)
            k = apply_rotary(self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1, self.head_dim), cos, sin)
        if self.scales_queries:
            q = q * rope[QUERY_SCALE][0]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The gated MLP, ``intermediate_size`` wide (default: the config's; an expert's is smaller)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps, dtype)
        self.self_attn = Attention(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.residual_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_cache: torch.Tensor, meta: AttentionMetadata | DecodeMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the stream is ``residual + x`` before this layer's
        attention (``x`` itself for the first layer), plus the attention output; the caller adds
        the MLP output, fused into the next norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names are Hugging Face's without the ``model.`` prefix, except the fused
    ``qkv_proj`` and ``gate_up_proj``; with tied embeddings there is no ``lm_head``.
    ``embed`` scales the embeddings by ``embed_scale`` (Granite's ``embedding_multiplier`` over its
    ``residual_multiplier``: the stream is carried divided by it; Gemma 3's square root of the width).
    Subclasses change ``layer_class``, ``embed_scale`` and ``convert_checkpoint_tensor``."""

    layer_class: type[nn.Module] = DecoderLayer
    # Whether every tensor's shape follows from the batch's: what compiled decode graphs need.
    compilable = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        # An explicit _weight skips nn.Embedding's random init: on the meta device, where the
        # loader builds the model, that init's first call costs a 1.5 s import of sympy.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(self.layer_class(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.residual_norm_eps, dtype)
        self.embed_scale = config.embedding_multiplier / config.residual_multiplier
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype, config.rotary_dim)
        self.local_rotary = self.no_rotary = None
        if config.local_rope_theta and config.sliding_window:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                config.local_rope_theta, None, dtype)
        if config.nope_layers:
            self.no_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                             config.rope_theta, None, dtype, rotary_dim=0)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    @staticmethod
    def convert_checkpoint_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """A Hugging Face checkpoint tensor as this model holds it: the final norm's weight divided
        by ``logits_scaling`` (in float32, before any cast), since only the logits read that norm;
        any other tensor unchanged."""
        if name == "model.norm.weight" and config.logits_scaling != 1.0:
            return tensor.float() / config.logits_scaling
        return tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)
        return embeddings if self.embed_scale == 1.0 else embeddings * self.embed_scale

    @property
    def rotaries(self) -> dict[str, RotaryEmbedding]:
        """The rotary tables by rope type (``ModelConfig.rope_type``): FULL, and SLIDING and NOPE
        where some layer takes them."""
        tables = {FULL: self.rotary, SLIDING: self.local_rotary, NOPE: self.no_rotary}
        return {rope_type: rotary for rope_type, rotary in tables.items() if rotary is not None}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata | DecodeMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm, for tokens
        ``input_ids`` at ``positions`` (both ``[num_tokens]``); writes their K/V into ``kv_caches``
        (one tensor per layer) at ``meta.slot_mapping``."""
        rope: Rope = {rope_type: rotary(positions) for rope_type, rotary in self.rotaries.items()}
        if self.config.query_temperature is not None:
            scale = query_temperature(positions, *self.config.query_temperature)
            rope[QUERY_SCALE] = (scale.to(self.rotary.cos.dtype)[:, None, None],)
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab_size]`` for hidden states ``[N, hidden_size]``."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
