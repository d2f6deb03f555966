"""The Llama-family forward (Llama, Mistral, Qwen2) from the Triton kernels and cuBLAS GEMMs,
over the same module and weights as ``vivace.models.llama`` (which the CPU backend runs).

Per layer: add + RMSNorm (one launch), the fused q/k/v GEMM, rotary + K/V write (one launch),
paged attention (one launch, two with split-K), the output GEMM, add + RMSNorm, the gate/up GEMM,
SiLU * mul, the down GEMM: 9-10 launches. Every tensor's shape depends on the batch's rows only,
never on sequence lengths, so a CUDA graph of a decode step replays for any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vivace.gpu import kernels
from vivace.gpu.gguf_linear import linear
from vivace.models.config import SLIDING
from vivace.models.llama import LlamaForCausalLM


@dataclass
class GpuBatch:
    """One flat batch, as tensors on the device. Decode batches (one query per sequence, row i
    being sequence i) leave ``query_start`` None and use the decode kernel with ``num_splits``;
    other batches list where each sequence's queries start (``[num_seqs + 1]``)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, width] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens after this step
    query_start: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_query_len: int = 1
    num_splits: int = 1


def check_supported(model: torch.nn.Module) -> None:
    """Raise ValueError for a model this forward does not run (yet)."""
    config = model.config
    if type(model) is not LlamaForCausalLM:
        raise ValueError(f"--device cuda runs the Llama family (Llama, Mistral, Qwen2); not {config.architecture} yet")
    if config.qk_norm:
        raise ValueError(f"--device cuda does not run per-head q/k norms ({config.architecture}) yet")
    if config.final_logit_softcapping is not None:
        raise ValueError("--device cuda does not run final logit soft-capping yet")


def forward(model: LlamaForCausalLM, batch: GpuBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """Hidden states ``[num_tokens, hidden]`` after the final norm; writes the batch's K/V."""
    config = model.config
    eps = config.rms_norm_eps
    tables = {None: (model.rotary.cos, model.rotary.sin)}
    if model.local_rotary is not None:
        tables[SLIDING] = (model.local_rotary.cos, model.local_rotary.sin)
    x = F.embedding(batch.input_ids, model.embed_tokens.weight)
    residual = None
    for layer, cache in zip(model.layers, kv_caches, strict=True):
        if residual is None:
            residual, h = x, kernels.rms_norm(x, layer.input_layernorm.weight, eps)
        else:
            h, residual = kernels.rms_norm(x, layer.input_layernorm.weight, eps, residual)
        attn = layer.self_attn
        qkv = linear(attn.qkv_proj, h)
        cos, sin = tables[SLIDING if attn.rope_type == SLIDING else None]
        q = kernels.rotary_kv_write(qkv, cos, sin, batch.positions, batch.slot_mapping, cache, attn.num_heads)
        if batch.query_start is None:
            o = kernels.paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens, attn.scale, attn.window,
                                               batch.num_splits)
        else:
            o = kernels.paged_prefill_attention(q, cache, batch.block_tables, batch.query_start, batch.seq_lens,
                                                batch.max_query_len, attn.scale, attn.window)
        x = linear(attn.o_proj, o.view(o.shape[0], -1))
        h, residual = kernels.rms_norm(x, layer.post_attention_layernorm.weight, eps, residual)
        mlp = layer.mlp
        x = linear(mlp.down_proj, kernels.silu_mul(linear(mlp.gate_up_proj, h)))
    return kernels.rms_norm(x, model.norm.weight, eps, residual)[0]
