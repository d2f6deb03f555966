"""Mixtures of experts: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) and Mixtral.

Their decoder is the Llama family's (``vivace.models.llama``; Qwen3-MoE has Qwen3's per-head
q/k norms) with the MLP of its sparse layers replaced by ``SparseMoeBlock``: a router linear
scores every expert, a float32 softmax over those scores gives each token's ``top_k`` experts and
their weights (renormalized to sum to one: Mixtral always, Qwen3-MoE with ``norm_topk_prob``),
and the token's output is the weighted sum of those experts' SiLU-gated MLPs. Each expert is an
``MLP`` of its own (gate/up fused like the dense one), so the CPU linear paths (oneDNN
prepacking, int8/int4 and GGUF weight-only quantization) apply to each expert's matrices
unchanged; the router stays a float linear.

A batch's rows are grouped by expert (sorted, gathered, run, gathered back and summed per token):
one pair of GEMMs per expert that some row chose, never a loop over tokens. Which experts run,
and on how many rows, depends on the values: no fixed-shape graph captures that, so these
models decode eagerly (``compilable`` False; the runner skips its compiled decode graphs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vivace.models.config import ModelConfig
from vivace.models.llama import MLP, DecoderLayer, LlamaForCausalLM

# Mixtral's checkpoint names of an expert's projections, as Qwen3-MoE (and vivace) names them.
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class SparseMoeBlock(nn.Module):
    """The sparse feed-forward of ``config.moe``: ``[num_tokens, hidden]`` in and out."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(MLP(config, dtype, moe.intermediate_size) for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, both ``[num_tokens, top_k]``: each token's chosen experts and
        their weights (in ``x``'s dtype), as transformers' top-k routers compute them."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        # The (token, choice) pairs sorted by expert, so that each expert's rows are contiguous.
        choices = experts.flatten()
        order = choices.argsort(stable=True)
        hit, counts = choices[order].unique_consecutive(return_counts=True)
        rows = x.index_select(0, order // self.top_k)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in zip(hit.tolist(), counts.tolist()):
            out[start:start + count] = self.experts[expert](rows[start:start + count])
            start += count
        # Back in (token, choice) order, each token's outputs weighted and summed, in an order no
        # batch changes: a gather, not a scatter-add (index_add_ took 0.1 to 3 ms a call on tiny
        # tensors on a 2-core CPU, index_select a few microseconds).
        out = out.index_select(0, order.argsort()).view(*experts.shape, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)


class MoeDecoderLayer(DecoderLayer):
    """A Llama-family layer whose MLP, in a sparse layer, is a ``SparseMoeBlock``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__(config, layer, dtype)  # on the meta device (the loader's): its dense MLP costs nothing
        if config.moe.sparse(layer):
            self.mlp = SparseMoeBlock(config, dtype)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE and Mixtral. Parameter names are the Llama family's, an expert's projections
    ``layers.N.mlp.experts.E.gate_up_proj`` and ``.down_proj``, the router ``layers.N.mlp.gate``."""

    layer_class = MoeDecoderLayer
    compilable = False


def expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each expert's projections under Qwen3-MoE's per-expert names
    (``model.layers.N.mlp.experts.E.gate_proj.weight``, ...), the router as ``mlp.gate``, whichever
    of the layouts they come in: per expert (what ``save_pretrained`` writes; Mixtral's
    ``block_sparse_moe.experts.E.w1``/``w3``/``w2``), or stacked as one ``[num_experts, out, in]``
    tensor a projection (transformers 5's in-memory ``mlp.experts.gate_up_proj`` and ``down_proj``,
    a GGUF's ``ffn_*_exps``), which is split into views of its matrices."""
    for name, tensor in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if "experts" not in parts:
            yield name, tensor
        elif tensor.dim() == 3:
            for expert, matrix in enumerate(tensor.unbind(0)):
                yield expert_name(name, expert), matrix
        else:
            at = parts.index("experts") + 2  # experts.E.<projection>
            parts[at] = _MIXTRAL_PROJECTIONS.get(parts[at], parts[at])
            yield ".".join(parts), tensor


def expert_name(stacked_name: str, expert: int) -> str:
    """The name of one expert's matrix of the stacked tensor ``stacked_name``:
    ``...mlp.experts.gate_up_proj`` or ``...mlp.experts.gate_proj.weight`` ->
    ``...mlp.experts.{expert}.gate_up_proj.weight`` or ``...mlp.experts.{expert}.gate_proj.weight``."""
    prefix, _, projection = stacked_name.removesuffix(".weight").rpartition(".")
    return f"{prefix}.{expert}.{projection}.weight"
