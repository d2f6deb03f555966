"""The decoder forward from the Triton kernels and cuBLAS GEMMs, over the same modules and weights
as ``vivace.models.llama`` and ``vivace.models.gemma3`` (which the CPU backend runs): the Llama
family (Llama, Mistral, Qwen2, Qwen3, Phi-3) and Gemma 3.

Per Llama layer: add + RMSNorm (one launch), the fused q/k/v GEMM, rotary + K/V write (one launch,
Qwen3's per-head q/k norms in it), paged attention (one launch, two with split-K), the output
GEMM, add + RMSNorm, the gate/up GEMM, SiLU * mul, the down GEMM: 9-10 launches. A Gemma 3 layer
adds a norm after attention and one after the MLP, and gates with GELU (tanh). Every tensor's
shape depends on the batch's rows only, never on sequence lengths, so a CUDA graph of a decode
step replays for any lengths. Projections go through ``gguf_linear.linear``: cuBLAS
(``F.linear``), or the GGUF kernels for a projection kept packed, or the FP8 ones (``fp8_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vivace.gpu import kernels
from vivace.gpu.gguf_linear import gated_linear, linear
from vivace.models.config import FULL, SLIDING
from vivace.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from vivace.models.llama import Attention, DecoderLayer, LlamaForCausalLM


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


def prompt_batch(ids: torch.Tensor, block_size: int) -> GpuBatch:
    """A batch of one whole prompt ``ids`` (on the device), its K/V in blocks 0, 1, 2, ..."""
    n, device = len(ids), ids.device
    positions = torch.arange(n, device=device)
    return GpuBatch(ids, positions, positions.clone(),
                    torch.arange(-(-n // block_size), dtype=torch.int32, device=device).view(1, -1),
                    torch.tensor([n], dtype=torch.int32, device=device),
                    torch.tensor([0, n], dtype=torch.int32, device=device), n)


def check_supported(model: torch.nn.Module) -> None:
    """Raise ValueError for a model this forward does not run."""
    if type(model) not in _LAYER_STEPS:
        raise ValueError(f"--device cuda runs the Llama family and Gemma 3; not {model.config.architecture}")


def forward(model: LlamaForCausalLM, batch: GpuBatch, kv_caches: list[torch.Tensor],
            kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Hidden states ``[num_tokens, hidden]`` after the final norm; writes the batch's K/V.
    Float8 caches need their ``kv_scales`` (one ``[2, num_kv_heads]`` tensor a layer)."""
    tables = {FULL: (model.rotary.cos, model.rotary.sin)}
    if model.local_rotary is not None:
        tables[SLIDING] = (model.local_rotary.cos, model.local_rotary.sin)
    layer_step = _LAYER_STEPS[type(model)]
    eps = model.config.rms_norm_eps
    x, residual = model.embed(batch.input_ids), None  # Gemma scales its embeddings there
    scales = kv_scales or [None] * len(kv_caches)
    for layer, cache, scale in zip(model.layers, kv_caches, scales, strict=True):
        if residual is None:
            residual, h = x, kernels.rms_norm(x, layer.input_layernorm.weight, eps)
        else:
            h, residual = kernels.rms_norm(x, layer.input_layernorm.weight, eps, residual)
        x, residual = layer_step(layer, _attention(layer.self_attn, h, tables, batch, cache, scale), residual, eps)
    return kernels.rms_norm(x, model.norm.weight, eps, residual)[0]


def _attention(attn: Attention, h: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
               batch: GpuBatch, cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """The attention block's output projection ``[num_tokens, hidden]`` for normed input ``h``;
    writes the batch's K/V into ``cache`` (float8 with its ``kv_scale``)."""
    qkv = linear(attn.qkv_proj, h)
    cos, sin = tables[attn.rope_type]
    norms = {} if attn.q_norm is None else dict(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                                                  eps=attn.q_norm.eps)
    q = kernels.rotary_kv_write(qkv, cos, sin, batch.positions, batch.slot_mapping, cache, attn.num_heads,
                                kv_scale=kv_scale, **norms)
    if batch.query_start is None:
        o = kernels.paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens, attn.scale, attn.window,
                                           batch.num_splits, kv_scale=kv_scale)
    else:
        o = kernels.paged_prefill_attention(q, cache, batch.block_tables, batch.query_start, batch.seq_lens,
                                            batch.max_query_len, attn.scale, attn.window, kv_scale=kv_scale)
    return linear(attn.o_proj, o.view(o.shape[0], -1))


def _llama_layer(layer: DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """After the attention: ``(MLP output, residual stream)``, as ``llama.DecoderLayer`` computes them."""
    h, residual = kernels.rms_norm(attn_out, layer.post_attention_layernorm.weight, eps, residual)
    mlp = layer.mlp
    return gated_linear(mlp.down_proj, linear(mlp.gate_up_proj, h)), residual


def _gemma3_layer(layer: Gemma3DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """After the attention: ``(post-feedforward-normed MLP output, residual stream)``, as
    ``gemma3.Gemma3DecoderLayer`` computes them (its norm weights already hold Gemma's ``1 + w``)."""
    h = kernels.rms_norm(attn_out, layer.post_attention_layernorm.weight, eps)
    h, residual = kernels.rms_norm(h, layer.pre_feedforward_layernorm.weight, eps, residual)
    mlp = layer.mlp
    x = gated_linear(mlp.down_proj, linear(mlp.gate_up_proj, h), gelu=True)
    return kernels.rms_norm(x, layer.post_feedforward_layernorm.weight, eps), residual


def choose_gemv(model: LlamaForCausalLM, blocks: tuple[int, ...] = (4, 8, 16), splits: tuple[int, ...] = (1, 2, 4),
                repeats: int = 20) -> dict:
    """For each projection shape of the layers (float ``nn.Linear`` only), time a batch-1 product
    of every layer's module in turn (as a decode step reads them, from HBM) through cuBLAS and
    through ``kernels.gemv`` at each of ``blocks`` rows a program and ``splits`` K splits (those
    leaving at least 1,024 columns a split), and mark the modules of each shape with the Triton
    variant where it wins (``gemv_block``, ``gemv_splits``; the down projection, with its activation,
    ``gated_gemv_block``, ``gated_gemv_splits``). CUDA only: graph replays timed by CUDA events,
    median of ``repeats``. Returns ``{shape name: (cuBLAS µs, best Triton µs, block or 0, splits)}``
    for the start-up log."""
    gelu = isinstance(model, Gemma3ForCausalLM)
    groups: dict[tuple, list[torch.nn.Module]] = {}
    for layer in model.layers:
        for role, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            if type(module) is torch.nn.Linear:
                groups.setdefault((role, *module.weight.shape, module.bias is not None), []).append(module)
    chosen = {}
    for (role, n, k, _), modules in groups.items():
        down = role == "down"
        prefix = "gated_gemv" if down else "gemv"
        x = torch.randn(1, 2 * k if down else k, dtype=modules[0].weight.dtype, device=modules[0].weight.device)
        candidates = [(0, 1)] + [(b, s) for b in blocks for s in splits if s == 1 or k // s >= 1024]
        times = {}
        for block, split in candidates:  # block 0: cuBLAS; each timed through the forward's own dispatch
            for module in modules:
                setattr(module, f"{prefix}_block", block)
                setattr(module, f"{prefix}_splits", split)
            times[block, split] = _time_us(lambda: [gated_linear(m, x, gelu) if down else linear(m, x)
                                                    for m in modules], repeats) / len(modules)
        best = min(candidates[1:], key=times.get)
        block, split = best if times[best] < 0.97 * times[0, 1] else (0, 1)
        for module in modules:
            setattr(module, f"{prefix}_block", block)
            setattr(module, f"{prefix}_splits", split)
        chosen[f"{role} {n}x{k}"] = (times[0, 1], times[best], block, split)
    return chosen


def _time_us(fn, repeats: int) -> float:
    """Median microseconds of ``fn``'s kernels replayed from a CUDA graph, as the decode step runs
    them, after two warm-up calls (compiles, cuBLAS handles) on a side stream. Not a Python loop of
    launches: Triton's launch from Python costs ~50 µs on an H200 with Triton 3.6, more than a
    small GEMV's kernel, so a loop timed the launch and ranked the candidates by it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return sorted(times)[len(times) // 2]


_LAYER_STEPS = {LlamaForCausalLM: _llama_layer, Gemma3ForCausalLM: _gemma3_layer}
