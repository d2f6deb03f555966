"""A GGUF of random weights at a bigger model's shape, for ``benchmarks/peers.py --model PATH``: no
model hub is reachable, and the bundled models are small. The file has the default model's
tokenizer, vocabulary and chat template (every server then tokenizes the same prompts alike), the
``llama`` architecture (``qwen3`` with its q and k norms for a Qwen3 config, ``gemma3`` with its four
norms a layer and sliding window for a Gemma 3 one) at the dimensions of a ``--load-format dummy``
preset, of ``gemma-3-1b`` or of a ``config.json`` (its vocabulary, biases and rope scaling are not
kept), norms of 1 and normal(0, 0.02) matrices in F16, Q8_0 or Q4_0. llama.cpp's
``llama-quantize`` makes the K-quant mixes (Q4_K_M, ...) from the F16 file.

    python benchmarks/random_gguf.py OUT.gguf [--shape llama-3.2-1b|CONFIG.json] [--type F16|Q8_0|Q4_0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from vivace.models.dummy import PRESETS, dummy_config
from vivace.models.loader import default_model_path

T = gguf.GGMLQuantizationType
ARCHS = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}  # model_type -> GGUF's
# Shapes beside the dummy presets (which leave out sliding-window models): Gemma 3 1B's config.json.
SHAPES = {**PRESETS, "gemma-3-1b": dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=512, max_position_embeddings=32768,
    tie_word_embeddings=True)}
# Norms a layer, by architecture (all ones: Gemma's files store 1 + w, so its weights are 0 as trained ones nearly are)
LAYER_NORMS = {"llama": ("attn_norm", "ffn_norm"), "qwen3": ("attn_norm", "ffn_norm"),
               "gemma3": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}
LAYER_MATRICES = {  # GGUF name -> (rows, columns) as functions of the config
    "attn_q": lambda c, d: (c["num_attention_heads"] * d, c["hidden_size"]),
    "attn_k": lambda c, d: (c["num_key_value_heads"] * d, c["hidden_size"]),
    "attn_v": lambda c, d: (c["num_key_value_heads"] * d, c["hidden_size"]),
    "attn_output": lambda c, d: (c["hidden_size"], c["num_attention_heads"] * d),
    "ffn_gate": lambda c, d: (c["intermediate_size"], c["hidden_size"]),
    "ffn_up": lambda c, d: (c["intermediate_size"], c["hidden_size"]),
    "ffn_down": lambda c, d: (c["hidden_size"], c["intermediate_size"]),
}


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Every ``tokenizer.*`` key of ``reader`` into ``writer``; returns the vocabulary size."""
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def add_matrix(writer: gguf.GGUFWriter, name: str, rng: np.random.Generator, shape: tuple[int, int],
               ggml_type: T) -> None:
    """A normal(0, 0.02) matrix, as float16 values or quantized blocks."""
    values = rng.standard_normal(shape, dtype=np.float32) * 0.02
    if ggml_type == T.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, ggml_type), raw_dtype=ggml_type)


def write(path: Path, shape: str, ggml_type: T, seed: int = 0) -> Path:
    """Writes the file; ``shape`` is a name of ``SHAPES`` or a config.json's path."""
    config = dict(SHAPES[shape]) if shape in SHAPES else dummy_config(shape)[0]
    if config.get("model_type") not in ARCHS:
        raise ValueError(f"{shape}: model_type {config.get('model_type')!r} is none of {', '.join(ARCHS)}")
    arch = ARCHS[config["model_type"]]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random {Path(shape).stem} shape")
    writer.add_file_type({T.F16: gguf.LlamaFileType.MOSTLY_F16, T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                          T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}[ggml_type])
    vocab = copy_tokenizer(source, writer)
    writer.add_vocab_size(vocab)
    writer.add_context_length(8192)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    rng = np.random.default_rng(seed)
    norm, head_norm = np.ones(config["hidden_size"], dtype=np.float32), np.ones(head_dim, dtype=np.float32)
    # llama.cpp's own files keep the token embedding in the file's type too.
    add_matrix(writer, "token_embd.weight", rng, (vocab, config["hidden_size"]), ggml_type)
    for layer in range(config["num_hidden_layers"]):
        for name in LAYER_NORMS[arch]:
            writer.add_tensor(f"blk.{layer}.{name}.weight", norm)
        if arch in ("qwen3", "gemma3"):
            writer.add_tensor(f"blk.{layer}.attn_q_norm.weight", head_norm)
            writer.add_tensor(f"blk.{layer}.attn_k_norm.weight", head_norm)
        for name, rows_columns in LAYER_MATRICES.items():
            add_matrix(writer, f"blk.{layer}.{name}.weight", rng, rows_columns(config, head_dim), ggml_type)
    writer.add_tensor("output_norm.weight", norm)
    if not config.get("tie_word_embeddings", False):
        add_matrix(writer, "output.weight", rng, (vocab, config["hidden_size"]), ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama-3.2-1b", help=f"{', '.join(SHAPES)}, or a config.json")
    parser.add_argument("--type", choices=["F16", "Q8_0", "Q4_0"], default="F16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write(args.out, args.shape, T[args.type], args.seed), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
