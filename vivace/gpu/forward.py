"""The decoder forward from the Triton kernels and cuBLAS GEMMs, over the same modules and weights
as ``vivace.models.llama`` and ``vivace.models.gemma3`` (which the CPU backend runs): the Llama
family (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite) and Gemma 3. Each layer rotates
with the table its config names (a NoPE layer's is the identity: cos 1, sin 0); Ministral 3's
queries are scaled by position before the rotation, which is linear, so the scale commutes with it.

Per Llama layer: add + RMSNorm (one launch), the fused q/k/v GEMM, rotary + K/V write (one launch,
Qwen3's per-head q/k norms in it), paged attention (one launch, two with split-K; a prompt step's
single-query rows in the decode kernel, its chunks in the prefill kernel), the output GEMM, add +
RMSNorm, the gate/up GEMM, SiLU * mul, the down GEMM: 9-10 launches. A Gemma 3 layer adds a norm
after attention and one after the MLP, and gates with GELU (tanh). Every tensor's shape depends
on the batch's rows only, never on sequence lengths, so a CUDA graph of a decode step replays for
any lengths. Projections go through ``linear``: cuBLAS (``F.linear``), at batch 1 the Triton GEMV
where it was measured faster at start (``choose_gemv``), or the module's own forward for a GGUF
projection kept packed (``gguf_linear``) or an FP8 one (``fp8_linear``).

At batch 1, where the Triton GEMV serves the projections, a Llama layer launches no norm kernel:
an RMSNorm is handed on unevaluated (``Normed``) and the q/k/v and gate/up GEMVs take it as they
load the residual stream, and the output and down GEMVs add their results into the residual
stream themselves (``kernels.gemv``'s ``norm_weight`` and ``residual``): 6 launches a layer
instead of 8. Gemma 3's norms sit between the projections and the residual adds, so only its
q/k/v takes the input norm. ``VIVACE_FOLD_NORMS=0`` (or ``FOLD_NORMS = False`` before graphs
are captured) launches the norms as their own kernels.

A decode batch (any size) has no launch of its own for rotary + K/V write either: the decode
attention kernel rotates the queries it holds and writes the new token's key and value
(``kernels.rotary_decode_attention``); ``VIVACE_FOLD_ROPE=0`` launches ``rotary_kv_write``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vivace.gpu import kernels
from vivace.layers.rotary import query_temperature
from vivace.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from vivace.models.llama import Attention, DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

FOLD_NORMS = os.environ.get("VIVACE_FOLD_NORMS", "1") != "0"
FOLD_ROPE = os.environ.get("VIVACE_FOLD_ROPE", "1") != "0"


@dataclass
class GpuBatch:
    """One flat batch, as tensors on the device. Decode batches (one query per sequence, row i
    being sequence i) leave ``query_start`` None and use the decode kernel with ``num_splits``;
    other batches list where each sequence's queries start (``[num_seqs + 1]``) and go through the
    prefill kernel, but for their sequences of one query where ``decode_row_splits`` > 0: those
    take the decode kernel with that many splits (0: the prefill kernel attends every row)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, width] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens after this step
    query_start: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_query_len: int = 1
    num_splits: int = 1
    decode_row_splits: int = 0


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
        raise ValueError(f"--device cuda runs the Llama family and Gemma 3; not {model.config.architecture}"
                         + (" (a mixture of experts: serve it with --device cpu)" if model.config.moe else ""))


def forward(model: LlamaForCausalLM, batch: GpuBatch, kv_caches: list[torch.Tensor],
            kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Hidden states ``[num_tokens, hidden]`` after the final norm; writes the batch's K/V.
    Float8 caches need their ``kv_scales`` (one ``[2, num_kv_heads]`` tensor a layer)."""
    tables = {rope_type: (rotary.cos, rotary.sin) for rope_type, rotary in model.rotaries.items()}
    query_scale = None
    if model.config.query_temperature is not None:
        query_scale = query_temperature(batch.positions, *model.config.query_temperature)[:, None]
    layer_step = _LAYER_STEPS[type(model)]
    adds_after_attention = layer_step is _llama_layer
    eps = model.norm.eps  # the residual stream's norms' (ModelConfig.residual_norm_eps)
    # The residual stream, and the last block's output not yet added into it (None: added already)
    residual, pending = model.embed(batch.input_ids), None  # Gemma scales its embeddings there
    scales = kv_scales or [None] * len(kv_caches)
    for layer, cache, scale in zip(model.layers, kv_caches, scales, strict=True):
        h, residual = _add_norm(pending, residual, layer.input_layernorm.weight, eps)
        pending = _attention(layer.self_attn, h, tables, batch, cache, scale,
                             residual if adds_after_attention else None, query_scale)
        pending, residual = layer_step(layer, pending, residual, eps)
    h, _ = _add_norm(pending, residual, model.norm.weight, eps)
    return h.tensor() if isinstance(h, Normed) else h


@dataclass
class Normed:
    """``rms_norm(x, weight, eps)``, not computed yet: a projection that reads it through the
    Triton GEMV takes the norm as it loads ``x`` (no launch of its own); any other computes it."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float

    def tensor(self) -> torch.Tensor:
        return kernels.rms_norm(self.x, self.weight, self.eps)


def _add_norm(pending: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
    """``(RMSNorm of residual + pending, residual + pending)``, the sum written into ``residual``
    (one launch); with nothing pending, the norm of ``residual`` as it stands, left to its reader."""
    if pending is None:
        return Normed(residual, weight, eps), residual
    return kernels.rms_norm(pending, weight, eps, residual)


def _gemv_block(module: nn.Module, x: torch.Tensor, prefix: str) -> int:
    """Rows a program of the Triton GEMV chosen at start for ``module`` (``{prefix}_block``) when
    ``x`` is one row, else 0: cuBLAS, or the module's own forward."""
    return getattr(module, f"{prefix}_block", 0) if isinstance(module, nn.Linear) and x.shape[0] == 1 else 0


def linear(module: nn.Module, x: torch.Tensor | Normed, residual: torch.Tensor | None = None
           ) -> torch.Tensor | None:
    """``module``'s ``x @ W^T + b`` for ``x`` (or the norm it stands for). With ``residual``: None
    when the product was added into ``residual`` (the Triton GEMV, norms folded), else the product,
    for the caller to add."""
    block = _gemv_block(module, x.x if isinstance(x, Normed) else x, "gemv")
    fold = bool(block) and FOLD_NORMS
    if isinstance(x, Normed) and not fold:
        x = x.tensor()
    if not block:
        return F.linear(x, module.weight, module.bias) if isinstance(module, nn.Linear) else module(x)
    norm = dict(norm_weight=x.weight, eps=x.eps) if isinstance(x, Normed) else {}
    add = residual if fold else None
    out = kernels.gemv(module.weight, x.x if isinstance(x, Normed) else x, module.bias, block_n=block,
                       splits=getattr(module, "gemv_splits", 1), residual=add, **norm)
    return None if add is not None else out


def gated_linear(module: nn.Module, x: torch.Tensor, gelu: bool = False, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
    """``linear(module, act(gate) * up, residual)`` for an MLP's ``x = [gate | up]`` (SiLU, or
    GELU's tanh form): at batch 1 through the Triton GEMV with the activation taken as it loads
    ``x`` where that was measured faster (``gated_gemv_block``), else the activation kernel, then
    ``linear``."""
    block = _gemv_block(module, x, "gated_gemv")
    if block:
        fold = residual is not None and FOLD_NORMS
        out = kernels.gemv(module.weight, x, module.bias, "gelu" if gelu else "silu", block_n=block,
                           splits=getattr(module, "gated_gemv_splits", 1), residual=residual if fold else None)
        return None if fold else out
    return linear(module, kernels.gelu_tanh_mul(x) if gelu else kernels.silu_mul(x), residual)


def _attention(attn: Attention, h: torch.Tensor | Normed, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
               batch: GpuBatch, cache: torch.Tensor, kv_scale: torch.Tensor | None,
               residual: torch.Tensor | None, query_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The attention block's output projection ``[num_tokens, hidden]`` for normed input ``h``
    (None where ``linear`` added it into ``residual``); writes the batch's K/V into ``cache``
    (float8 with its ``kv_scale``). ``query_scale`` ``[num_tokens, 1]`` multiplies the queries."""
    qkv = linear(attn.qkv_proj, h)
    if query_scale is not None:  # before the rotation (in the kernels), as linear as it: the same product
        qkv[:, :attn.num_heads * attn.head_dim] *= query_scale.to(qkv.dtype)
    cos, sin = tables[attn.rope_type]
    norms = {} if attn.q_norm is None else dict(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                                                  eps=attn.q_norm.eps)
    if batch.query_start is None and FOLD_ROPE:
        o = kernels.rotary_decode_attention(qkv, cos, sin, batch.positions, batch.slot_mapping, cache,
                                            attn.num_heads, batch.block_tables, batch.seq_lens, attn.scale,
                                            attn.window, batch.num_splits, kv_scale=kv_scale, **norms)
        return linear(attn.o_proj, o.view(o.shape[0], -1), residual)
    q = kernels.rotary_kv_write(qkv, cos, sin, batch.positions, batch.slot_mapping, cache, attn.num_heads,
                                kv_scale=kv_scale, **norms)
    if batch.query_start is None:
        o = kernels.paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens, attn.scale, attn.window,
                                           batch.num_splits, kv_scale=kv_scale)
    else:
        o = kernels.paged_prefill_attention(q, cache, batch.block_tables, batch.query_start, batch.seq_lens,
                                            batch.max_query_len, attn.scale, attn.window, kv_scale=kv_scale,
                                            decodes_apart=batch.decode_row_splits > 0)
        if batch.decode_row_splits:
            kernels.paged_decode_attention(q, cache, batch.block_tables, batch.seq_lens, attn.scale, attn.window,
                                           batch.decode_row_splits, o, kv_scale=kv_scale,
                                           query_start=batch.query_start)
    return linear(attn.o_proj, o.view(o.shape[0], -1), residual)


def _llama_layer(layer: DecoderLayer, attn_out: torch.Tensor | None, residual: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """After the attention: ``(MLP output not yet added, residual stream)``, as
    ``llama.DecoderLayer`` computes them (``attn_out`` None: added already)."""
    h, residual = _add_norm(attn_out, residual, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    return gated_linear(mlp.down_proj, linear(mlp.gate_up_proj, h), residual=residual), residual


def _gemma3_layer(layer: Gemma3DecoderLayer, attn_out: torch.Tensor, residual: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """After the attention: ``(post-feedforward-normed MLP output, residual stream)``, as
    ``gemma3.Gemma3DecoderLayer`` computes them (its norm weights already hold Gemma's ``1 + w``)."""
    h = kernels.rms_norm(attn_out, layer.post_attention_layernorm.weight, eps)
    h, residual = kernels.rms_norm(h, layer.pre_feedforward_layernorm.weight, eps, residual)
    mlp = layer.mlp
    x = gated_linear(mlp.down_proj, linear(mlp.gate_up_proj, h), gelu=True)
    return kernels.rms_norm(x, layer.post_feedforward_layernorm.weight, eps), residual


@dataclass
class GemvChoice:
    """What ``choose_gemv`` measured for one projection shape: the default path's µs a product
    (cuBLAS; for FP8 and GGUF modules their launcher's own tiling), the best candidate's, and what
    the modules keep."""

    default_us: float
    best_us: float
    kept: str


def choose_gemv(model: LlamaForCausalLM, blocks: tuple[int, ...] = (4, 8, 16), splits: tuple[int, ...] = (1, 2, 4),
                repeats: int = 20) -> dict[str, GemvChoice]:
    """For each projection shape of the layers, time a batch-1 product of every layer's module in
    turn (as a decode step reads them, from HBM), through the forward's own dispatch with its
    inputs as the forward hands them (a ``Normed`` where a norm may fold in, the residual stream
    where the product may add into it), and keep the fastest way. Float ``nn.Linear``: cuBLAS
    against ``kernels.gemv`` at each of ``blocks`` rows a program and ``splits`` K splits (those
    leaving at least 1,024 columns a split), the Triton variant kept where it is at least 3% faster
    (``gemv_block``, ``gemv_splits``; the down projection, with its activation, ``gated_gemv_block``,
    ``gated_gemv_splits``). A module with ``gemv_candidates()`` (FP8, GGUF): each of its
    ``GemvConfig`` candidates against the launcher's defaults, the best kept as ``gemv_config``
    where it is 3% faster. CUDA only: graph replays timed by CUDA events, median of ``repeats``."""
    llama = not isinstance(model, Gemma3ForCausalLM)
    eps = model.norm.eps
    groups: dict[tuple, list[tuple[nn.Module, torch.Tensor | None]]] = {}
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for role, module, norm in (("qkv", attn.qkv_proj, layer.input_layernorm.weight), ("o", attn.o_proj, None),
                                   ("gate_up", mlp.gate_up_proj, layer.post_attention_layernorm.weight if llama else None),
                                   ("down", mlp.down_proj, None)):
            for member in getattr(module, "parts", (module,)):  # a StackedLinear: each run chosen apart
                if type(member) is nn.Linear or hasattr(member, "gemv_candidates"):
                    ggml_type = getattr(member, "ggml_type", None)
                    key = (role, type(member).__name__, ggml_type.name if ggml_type is not None else "",
                           member.out_features, member.in_features, member.bias is not None)
                    groups.setdefault(key, []).append((member, norm))
    chosen = {}
    like = dict(dtype=model.norm.weight.dtype, device=model.norm.weight.device)  # the activations'
    for (role, kind, ggml_type, n, k, _), members in groups.items():
        x = torch.randn(1, 2 * k if role == "down" else k, **like)
        residual = torch.randn(1, n, **like) if llama and role in ("o", "down") else None

        def products(members=members, x=x, residual=residual, role=role) -> None:
            for module, norm in members:
                if role == "down":
                    gated_linear(module, x, not llama, residual)
                else:
                    linear(module, x if norm is None else Normed(x, norm, eps), residual)

        name = f"{role} {n}x{k}" + ("" if kind == "Linear" else f" {ggml_type or kind}")
        modules = [module for module, _ in members]
        if kind == "Linear":
            chosen[name] = _choose_float(modules, "gated_gemv" if role == "down" else "gemv", k, products, blocks,
                                         splits, repeats)
        else:
            chosen[name] = _choose_config(modules, k, products, repeats, like)
    return chosen


def _choose_float(modules: list[nn.Linear], prefix: str, k: int, products, blocks: tuple[int, ...],
                  splits: tuple[int, ...], repeats: int) -> GemvChoice:
    """``choose_gemv`` for float modules: cuBLAS or the Triton GEMV, set as ``{prefix}_block``/``_splits``."""
    candidates = [(0, 1)] + [(b, s) for b in blocks for s in splits if s == 1 or k // s >= 1024]

    def keep(block: int, split: int) -> None:
        for module in modules:
            setattr(module, f"{prefix}_block", block)
            setattr(module, f"{prefix}_splits", split)

    times = {}
    for block, split in candidates:  # block 0: cuBLAS
        keep(block, split)
        times[block, split] = _time_or_inf(products, repeats, f"GEMV {block} rows, K in {split}") / len(modules)
    best = min(candidates[1:], key=times.get)
    kept = best if times[best] < 0.97 * times[0, 1] else (0, 1)
    keep(*kept)
    return GemvChoice(times[0, 1], times[best],
                      f"Triton GEMV, {kept[0]} rows a program, K in {kept[1]}" if kept[0] else "cuBLAS")


def _choose_config(modules: list[nn.Module], k: int, products, repeats: int, like: dict) -> GemvChoice:
    """``choose_gemv`` for FP8/GGUF modules: the launcher's defaults or one of ``gemv_candidates()``,
    set as ``gemv_config``; ``like``: the activations' dtype and device."""
    candidates = modules[0].gemv_candidates()

    def keep(config: kernels.GemvConfig | None) -> None:
        for module in modules:
            module.gemv_config = config

    keep(None)
    default = _time_us(products, repeats) / len(modules)
    times = []
    for config in candidates:
        keep(config)
        times.append(_time_or_inf(products, repeats, str(config)) / len(modules))
    best = min(range(len(candidates)), key=times.__getitem__, default=None)
    kept = candidates[best] if best is not None and times[best] < 0.97 * default else None
    if kept is not None:  # timed at one row of x; decode batches of up to 8 rows take it too
        keep(kept)
        kept = kept if _time_or_inf(lambda: modules[0](torch.randn(8, k, **like)), 1, f"{kept} at 8 rows") < INF \
            else None
    keep(kept)
    return GemvChoice(default, default if best is None else times[best],
                      "defaults" if kept is None else str(kept).removeprefix("GemvConfig"))


INF = float("inf")


def _time_or_inf(fn, repeats: int, what: str) -> float:
    """``_time_us(fn, repeats)``, or infinity where a candidate does not compile or launch on this
    GPU (too many registers or too much shared memory for a tiling): it is skipped, not fatal."""
    try:
        return _time_us(fn, repeats)
    except Exception as exc:  # noqa: BLE001 - Triton's compile and resource errors have no common base
        logger.warning("batch-1 GEMV candidate %s skipped: %s", what, exc)
        return INF


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
