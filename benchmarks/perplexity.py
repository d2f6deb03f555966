"""Perplexity of a model's quantized forms against its float weights on a fixed text.

    python benchmarks/perplexity.py [--model gemma-3-270m] [--quantizations none gguf fp8] [--text FILE]
                                    [--kv-dtypes float32 float16] [--dtype bfloat16] [--llama-ctx N]
                                    [--device cuda --dtype bfloat16 --kv-dtypes bfloat16 fp8]

Each quantization loads the same file ("none": the GGUF's values dequantized to float32; "gguf":
its own formats through the native kernels, int8 activations included; "fp8": the decoder
projections in e4m3 with per-channel scales but those of ``float_layers``,
``vivace.gpu.fp8_linear``: at ``--dtype bfloat16`` its prefill quantizes the activations per token
too, as the GPU's prefill does; at float32 it is weight-only, as the GPU's decode GEMV is;
"fp8-ref": the same arithmetic in float32 torch ops, fast on a CPU, where the FP8 kernels run
under Triton's interpreter: weights rounded to e4m3 per output row by ``quantize_weight``, the
layers ``float_layers`` names kept in float, and a prefill's activations rounded per token as
``quantize_rows`` rounds them before ``torch._scaled_mm``; "fp8-ref-all": with every decoder layer
in FP8), scores the whole text in one prefill and prints its perplexity, the change from the
first quantization listed, and how often the two agree on the top-1 next token; with several
``--kv-dtypes``, every quantization runs with its KV cache in each (the prompt's attention reads
its keys and values back from the cache, as serving does). The default text is the English passage
the quantization tests use (tests/data/quant_text.txt, 517 tokens of the default model); a longer one,
public-domain prose, is tests/data/moby_dick_loomings.txt (chapter 1 of Melville's Moby-Dick, 2,859
tokens).

``--device cuda`` scores through the CUDA backend's forward (``vivace.gpu``: Triton attention over
a paged cache, GGUF projections kept packed with "gguf"), with weights in ``--dtype``; there the KV
cache may also be ``fp8`` (float8 e4m3 with the per-head scales the CUDA runner calibrates).

``--llama-ctx N`` scores the text as llama.cpp's ``llama-perplexity -c N -b N`` does, so that the
two figures compare: the tokens in chunks of N (the rest dropped), each chunk's first token
replaced by BOS and run in a prefill of its own, only the second half of each chunk scored.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vivace.layers.attention import AttentionMetadata
from vivace.models import LoadedModel, load_model
from vivace.models.llama import kv_cache_shape

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quant_text.txt"
BLOCK_SIZE = 16
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8": torch.float8_e4m3fn}


def text_logits(model_name: str, quantization: str, text: str, kv_dtype: torch.dtype = torch.float32,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, float32 logits at every position) of one prefill over ``text`` on ``device``."""
    if quantization.startswith("fp8-ref"):
        loaded = fp8_reference(model_name, keep_float_layers=quantization == "fp8-ref")
    else:
        loaded = load_model(model_name, dtype, quantization, device=device)
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"])
    if device == "cuda":
        return ids, gpu_prefill_logits(loaded, ids, kv_dtype)
    return ids, prefill_logits(loaded, ids, kv_dtype)


def fp8_reference(model_name: str, keep_float_layers: bool = True) -> LoadedModel:
    """``model_name`` in float32 with ``--quantization fp8``'s rounding done by torch ops ("fp8-ref",
    module docstring)."""
    from vivace.gpu.fp8_kernels import GEMV_MAX_ROWS, quantize_weight
    from vivace.gpu.fp8_linear import float_layers

    def rounded(rows: torch.Tensor) -> torch.Tensor:  # each row to e4m3 with its own scale, and back
        codes, scale = quantize_weight(rows)
        return codes.float() * scale[:, None]

    def round_rows(module: nn.Module, args: tuple) -> tuple | None:
        rows = args[0].reshape(-1, args[0].shape[-1])
        if len(rows) <= GEMV_MAX_ROWS:  # the decode GEMV: weight-only
            return None
        return (rounded(rows).view_as(args[0]), *args[1:])

    loaded = load_model(model_name, torch.float32, "none")
    kept = float_layers(len(loaded.model.layers)) if keep_float_layers else set()
    with torch.no_grad():
        for index, layer in enumerate(loaded.model.layers):
            if index in kept:
                continue
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(rounded(module.weight))
                    module.register_forward_pre_hook(round_rows)
    return loaded


def llama_perplexity(model_name: str, quantization: str, text: str, n_ctx: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``text`` as ``llama-perplexity -c n_ctx`` scores it (module docstring)."""
    loaded = load_model(model_name, torch.float32, quantization)
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"])
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ids[start:start + n_ctx].clone()
        chunk[0] = loaded.tokenizer.bos_token_id
        logits = prefill_logits(loaded, chunk)
        nll += F.cross_entropy(logits[first:-1].double(), chunk[first + 1:], reduction="sum").item()
        count += n_ctx - 1 - first
    return math.exp(nll / count), count


@torch.inference_mode()
def prefill_logits(loaded: LoadedModel, ids: torch.Tensor, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 logits at every position of one prefill over the token ids ``ids``."""
    blocks = -(-len(ids) // BLOCK_SIZE)
    caches = [torch.zeros(kv_cache_shape(loaded.config, blocks, BLOCK_SIZE), dtype=kv_dtype)
              for _ in range(loaded.config.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(len(ids)), query_lens=[len(ids)], seq_lens=[len(ids)],
                             block_tables=torch.arange(blocks).unsqueeze(0), block_size=BLOCK_SIZE)
    hidden = loaded.model(ids, torch.arange(len(ids)), caches, meta)
    return loaded.model.compute_logits(hidden)


@torch.inference_mode()
def gpu_prefill_logits(loaded: LoadedModel, ids: torch.Tensor, kv_dtype: torch.dtype, device: str = "cuda"
                       ) -> torch.Tensor:
    """``prefill_logits`` through the CUDA backend's forward (on ``device``: a CPU one runs it under
    Triton's interpreter); a float8 cache with the scales the CUDA runner would use."""
    from vivace.gpu import kv_fp8
    from vivace.gpu.forward import forward, prompt_batch

    blocks = -(-len(ids) // BLOCK_SIZE)
    caches = [torch.zeros(kv_cache_shape(loaded.config, blocks, BLOCK_SIZE), dtype=kv_dtype, device=device)
              for _ in range(loaded.config.num_hidden_layers)]
    scales = None
    if kv_dtype == torch.float8_e4m3fn:
        scales = kv_fp8.kv_scales(loaded, BLOCK_SIZE, kv_fp8.CALIBRATION_TOKENS, device)
    batch = prompt_batch(ids.to(device), BLOCK_SIZE)
    return loaded.model.compute_logits(forward(loaded.model, batch, caches, scales)).float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--quantizations", nargs="+", default=["none", "gguf"])
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32"],
                        choices=["float32", "float16", "bfloat16", "fp8"], help="fp8: --device cuda only")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="weights and activations (float32 on the CPU)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-ctx", type=int, help="score as llama-perplexity -c N does (module docstring)")
    args = parser.parse_args()
    if "fp8" in args.kv_dtypes and args.device != "cuda":
        parser.error("--kv-dtypes fp8 needs --device cuda")
    torch.set_num_threads(args.threads)
    text = args.text.read_text()
    if args.llama_ctx:
        print("| quantization | chunks of | tokens scored | perplexity |\n|---|---|---|---|")
        for quantization in args.quantizations:
            ppl, count = llama_perplexity(args.model, quantization, text, args.llama_ctx)
            print(f"| {quantization} | {args.llama_ctx} | {count} | {ppl:.3f} |", flush=True)
        return
    base: tuple[float, torch.Tensor] | None = None
    print("| quantization | KV cache | tokens | perplexity | vs first | top-1 agreement |\n|---|---|---|---|---|---|")
    for quantization in args.quantizations:
        for kv_dtype in args.kv_dtypes:
            ids, logits = text_logits(args.model, quantization, text, KV_DTYPES[kv_dtype], args.device,
                                      getattr(torch, args.dtype))
            ppl = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
            top1 = logits.argmax(-1)
            base = base or (ppl, top1)
            agreement = (top1 == base[1]).float().mean().item()
            print(f"| {quantization} | {kv_dtype} | {len(ids)} | {ppl:.3f} | {ppl / base[0] - 1:+.2%} | {agreement:.1%} |",
                  flush=True)


if __name__ == "__main__":
    main()
