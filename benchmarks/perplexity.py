"""Perplexity of a model's quantized forms against its float weights on a fixed text.

    python benchmarks/perplexity.py [--model gemma-3-270m] [--quantizations none gguf] [--text FILE]

Each quantization loads the same file ("none": the GGUF's values dequantized to float32; "gguf":
its own formats through the native kernels, int8 activations included), scores the whole text in
one prefill and prints its perplexity, the change from the first quantization listed, and how
often the two agree on the top-1 next token. The default text is the English passage the
quantization tests use (tests/data/quant_text.txt).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from vivace.layers.attention import AttentionMetadata
from vivace.models import load_model
from vivace.models.llama import kv_cache_shape

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quant_text.txt"
BLOCK_SIZE = 16


@torch.inference_mode()
def text_logits(model_name: str, quantization: str, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, float32 logits at every position) of one prefill over ``text``."""
    loaded = load_model(model_name, torch.float32, quantization)
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"])
    blocks = -(-len(ids) // BLOCK_SIZE)
    caches = [torch.zeros(kv_cache_shape(loaded.config, blocks, BLOCK_SIZE))
              for _ in range(loaded.config.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(len(ids)), query_lens=[len(ids)], seq_lens=[len(ids)],
                             block_tables=torch.arange(blocks).unsqueeze(0), block_size=BLOCK_SIZE)
    hidden = loaded.model(ids, torch.arange(len(ids)), caches, meta)
    return ids, loaded.model.compute_logits(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--quantizations", nargs="+", default=["none", "gguf"])
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = args.text.read_text()
    base: tuple[float, torch.Tensor] | None = None
    print("| quantization | tokens | perplexity | vs first | top-1 agreement |\n|---|---|---|---|---|")
    for quantization in args.quantizations:
        ids, logits = text_logits(args.model, quantization, text)
        ppl = math.exp(F.cross_entropy(logits[:-1], ids[1:]).item())
        top1 = logits.argmax(-1)
        base = base or (ppl, top1)
        agreement = (top1 == base[1]).float().mean().item()
        print(f"| {quantization} | {len(ids)} | {ppl:.3f} | {ppl / base[0] - 1:+.2%} | {agreement:.1%} |", flush=True)


if __name__ == "__main__":
    main()
