"""Kernel launches of one batch-1 decode step of the CUDA backend (forward + LM head, the part a
decode graph holds before the sampler), counted on CPU: no GPU needed. On a GPU each launch in
a graph still costs its ramp and tail (~2-4 µs on an H200 against a SmolLM2 layer's ~2 µs of
bytes), so their number is what batch-1 decode of small models is made of.

    python benchmarks/launch_count.py [--presets smollm2-135m,llama-3.2-1b,llama-3.1-8b] [--context 512]

Per preset, random weights at its shape with 1 and 2 decoder layers (the count is linear in the
layers: the real count is extrapolated), every projection on the Triton GEMV (as
``forward.choose_gemv`` sets where it beats cuBLAS; ``--splits`` K splits for the down
projection), under Triton's interpreter with the Triton launches counted and not run, and the
torch ops that launch kernels on a GPU (``aten`` ops other than views and allocations) counted
beside them; for each fold setting of ``vivace.gpu.forward`` (norms, rotary) on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

# aten ops that allocate or reinterpret memory: no kernel on a GPU
NO_KERNEL = ("view", "reshape", "_unsafe_view", "empty", "empty_like", "empty_strided", "as_strided", "alias",
             "detach", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
             "lift_fresh", "_reshape_alias", "split", "split_with_sizes", "unbind", "resolve_conj", "resolve_neg")


def count(model, context: int, splits: int, fold_norms: bool, fold_rope: bool) -> dict[str, int]:
    """Launches of one batch-1 decode step at ``context`` cached tokens: Triton's, torch's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from vivace.gpu import forward as gpu_forward
    from vivace.gpu import kernels
    from vivace.gpu.forward import GpuBatch

    config = model.config
    block_size = 16
    blocks = -(-(context + 1) // block_size)
    head_dim = config.head_dim
    caches = [torch.zeros(2, blocks + 1, block_size, config.num_key_value_heads, head_dim, dtype=torch.bfloat16)
              for _ in model.layers]
    batch = GpuBatch(torch.ones(1, dtype=torch.long), torch.tensor([context]), torch.tensor([context]),
                     torch.arange(blocks, dtype=torch.int32).view(1, -1),
                     torch.tensor([context + 1], dtype=torch.int32),
                     num_splits=kernels.decode_splits(context + 1, 1, config.num_key_value_heads))
    triton_launches, torch_ops = [0], {}

    inside = [False]

    def run(self, *args, grid, warmup, **kwargs):
        triton_launches[0] += 1
        inside[0] = True  # ids and indices it would have written stay valid for what follows
        for value in args:
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                value.zero_()
        inside[0] = False

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in NO_KERNEL and not inside[0]:
                torch_ops[name] = torch_ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    saved = InterpretedFunction.run, gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE
    InterpretedFunction.run = run
    gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE = fold_norms, fold_rope
    try:
        with torch.inference_mode(), Ops():
            model.compute_logits(gpu_forward.forward(model, batch, caches))
    finally:
        InterpretedFunction.run, gpu_forward.FOLD_NORMS, gpu_forward.FOLD_ROPE = saved
    return {"triton": triton_launches[0], "torch": sum(torch_ops.values()), "torch_ops": torch_ops}


def preset_counts(preset: str, context: int, splits: int) -> dict:
    import torch

    from vivace.models import load_model
    from vivace.models.dummy import PRESETS

    layers = PRESETS[preset]["num_hidden_layers"]
    by_layers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            path = Path(tmp, f"{preset}-{n}")
            path.mkdir()
            (path / "config.json").write_text(json.dumps(dict(PRESETS[preset], num_hidden_layers=n)))
            model = load_model(str(path), torch.bfloat16, load_format="dummy", device="cpu",
                               tokenizer=os.environ.get("VIVACE_TEST_TOKENIZER")).model
            for layer in model.layers:  # every projection on the Triton GEMV
                for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
                    module.gemv_block, module.gemv_splits = 8, 1
                layer.mlp.down_proj.gated_gemv_block, layer.mlp.down_proj.gated_gemv_splits = 8, splits
            by_layers[n] = {f"norms {'folded' if norms else 'launched'}, rotary {'folded' if rope else 'launched'}":
                            count(model, context, splits, norms, rope)
                            for norms, rope in ((False, False), (True, False), (True, True))}
    result = {}
    for name, one in by_layers[1].items():
        two = by_layers[2][name]
        per_layer = (two["triton"] + two["torch"]) - (one["triton"] + one["torch"])
        fixed = one["triton"] + one["torch"] - per_layer
        result[name] = {"per_layer": per_layer, "fixed": fixed, "layers": layers, "step": fixed + per_layer * layers,
                        "torch_ops_one_layer": one["torch_ops"]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--splits", type=int, default=2, help="K splits of the down projection's GEMV")
    args = parser.parse_args()
    print("| preset | launches | a layer | outside the layers | a decode step |\n|---|---|---|---|---|")
    for preset in args.presets.split(","):
        for name, row in preset_counts(preset, args.context, args.splits).items():
            print(f"| {preset} ({row['layers']} layers) | {name} | {row['per_layer']} | {row['fixed']} | "
                  f"{row['step']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
