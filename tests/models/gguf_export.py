"""Write a tiny transformers model as a GGUF the way llama.cpp's convert_hf_to_gguf.py does:
its metadata keys, tensor names, q/k row permutation (llama-arch models only), rope_freqs for
llama3 scaling, Phi-3's LongRoPE factor tensors, YaRN's keys, the rotary dims of partial
rotary, Granite's multipliers as llama.cpp's scales, Gemma's norms stored as 1 + w, norms and
biases in F32, a mixture's experts stacked into one [num_experts, out, in] tensor a projection
(router in F32), and a byte-level ("gpt2") tokenizer.
Mixtral is llama arch with expert_count, as convert_hf_to_gguf writes it."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from layers.gguf_random import random_blocks  # tests/ is on sys.path, as for every test package
from vivace.models.dummy import GGUF_HALF_FIELDS
from .tiny import BOS_ID, CHAT_TEMPLATE, EOS_ID, MERGES, SPECIAL_TOKENS, TOKENS

F32 = gguf.GGMLQuantizationType.F32
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_GEMMA3_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_QKV = ("attn_q", "attn_k", "attn_v")
# The quantized types the gguf package writes from float values; others get random codes.
QUANTIZABLE = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
               gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1)
# A SentencePiece vocabulary as large as TOKENS, its <s> and </s> at BOS_ID and EOS_ID: byte tokens,
# pieces (the longer, the better their score), then <unk> and the control tokens.
SPM_TOKENS = ([f"<0x{byte:02X}>" for byte in range(256)] + ["▁", "a", "b", "▁a", "▁b", "ab"]
              + ["<unk>", "<s>", "</s>"])
SPM_SCORES = {"▁a": -1.0, "▁b": -1.0, "ab": -2.0, "▁": -3.0, "a": -3.0, "b": -3.0}
SPM_TYPES = {"<unk>": gguf.TokenType.UNKNOWN, "<s>": gguf.TokenType.CONTROL, "</s>": gguf.TokenType.CONTROL}
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
         "gemma3_text": "gemma3", "smollm3": "smollm3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
         "granite": "granite"}


def write_gguf(model: transformers.PreTrainedModel, path: Path,
               ggml_type: gguf.GGMLQuantizationType = F32,
               types: dict[str, gguf.GGMLQuantizationType] | None = None, eos_id: int = EOS_ID,
               chat_template: str | list[dict[str, str]] = CHAT_TEMPLATE,
               token_ids: dict[str, int] | None = None, fuse_qkv: bool = False, vocabulary: str = "gpt2") -> Path:
    """Export ``model`` to ``path``; matrices are stored as ``ggml_type`` (F32, F16, or a quant),
    or as ``types[part]`` for the GGUF tensor part named (``attn_q``, ``token_embd``, ...); the
    metadata's EOS is ``eos_id``, its chat template ``chat_template`` (named ones: a list, as llama.cpp's
    converter takes tokenizer_config.json's), and ``token_ids`` more keys naming tokens
    (``tokenizer.ggml.fim_sep_token_id``: id); ``fuse_qkv`` stores each layer's q, k and v (weights
    and biases, after the q/k permutation) as one ``attn_qkv``, as the converter's ``--fuse-qkv`` does.
    Types the gguf package cannot quantize to (the K-quants) get random codes of that type.
    ``vocabulary`` is the tokenizer's kind: "gpt2" (byte-level BPE, ``TOKENS``), "llama-bpe" (the same as
    Llama 3's pre-tokenizer, without the merge of "Ġt" and "he": " the" is one token only as a whole word)
    "llama" (SentencePiece, ``SPM_TOKENS``: Llama 2's and Mistral 7B's kind) or "llama-no-space-prefix" (that
    without SentencePiece's dummy prefix: add_space_prefix false)."""
    config = model.config
    arch = ARCHS[config.model_type]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{config.model_type}")
    _add_hparams(writer, config, arch)
    _add_tokenizer(writer, eos_id, chat_template, vocabulary)
    qkv: dict[str, dict[str, np.ndarray]] = {}
    for key, token_id in (token_ids or {}).items():
        writer.add_uint32(key, token_id)
    for name, values in _unfused_experts(model.state_dict()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = _llama_cpp_order(values.numpy(), name, config, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0
        gguf_name = _gguf_name(name, arch)
        part = gguf_name.split(".")[-2]
        if fuse_qkv and part in _QKV:
            fused = qkv.setdefault(gguf_name.replace(part, "attn_qkv"), {})
            fused[part] = values
            if len(fused) < len(_QKV):
                continue
            gguf_name, part, values = gguf_name.replace(part, "attn_qkv"), "attn_qkv", np.concatenate(
                [fused[p] for p in _QKV])
        _add_tensor(writer, gguf_name, values, F32 if part == "ffn_gate_inp" else (types or {}).get(part, ggml_type))
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _unfused_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """transformers 5's in-memory experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``)
    as convert_hf_to_gguf stacks the checkpoint's per-expert matrices: gate, up and down apart."""
    tensors = []
    for name, values in state.items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = values.chunk(2, dim=1)
            tensors += [(name.replace("gate_up_proj", "gate_proj.weight"), gate),
                        (name.replace("gate_up_proj", "up_proj.weight"), up)]
        else:
            tensors.append((f"{name}.weight" if name.endswith(".experts.down_proj") else name, values))
    return tensors


def _head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_hparams(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig, arch: str) -> None:
    head_dim = _head_dim(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "granite":  # GraniteModel.set_gguf_parameters
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if getattr(config, "sliding_window", None) and arch == "phi3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        _add_gemma3(writer, config)
    writer.add_vocab_size(config.vocab_size)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] in ("longrope", "yarn"):
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "longrope":  # Phi3MiniModel's attention factor, from the context ratio
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_attn_factors(attn_factor if scale > 1.0 else 1.0)
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                getattr(writer, f"add_rope_scaling_yarn_{key}")(rope[key])


def _add_gemma3(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    """Gemma3Model.set_gguf_parameters' window (none when no layer slides) and final logit soft-capping; a
    layer pattern other than llama.cpp's default (every 6th layer global) as the one flag a layer that
    llama.cpp reads (``attention.sliding_window_pattern``; its Gemma 3n and Gemma 4 converters write it)."""
    sliding = [kind == "sliding_attention" for kind in config.layer_types]
    if any(sliding):
        writer.add_sliding_window(config.sliding_window)
    if sliding != [(i + 1) % 6 != 0 for i in range(config.num_hidden_layers)]:
        writer.add_sliding_window_pattern(sliding)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _add_tokenizer(writer: gguf.GGUFWriter, eos_id: int, chat_template: str | list[dict[str, str]],
                   vocabulary: str) -> None:
    if vocabulary in ("llama", "llama-no-space-prefix"):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(SPM_TOKENS)
        writer.add_token_scores([SPM_SCORES.get(t, 0.0) for t in SPM_TOKENS])
        byte, normal = gguf.TokenType.BYTE, gguf.TokenType.NORMAL
        writer.add_token_types([SPM_TYPES.get(t, byte if t.startswith("<0x") else normal) for t in SPM_TOKENS])
        writer.add_unk_token_id(SPM_TOKENS.index("<unk>"))
        writer.add_add_space_prefix(vocabulary == "llama")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(TOKENS)
        control = gguf.TokenType.CONTROL
        writer.add_token_types([control if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in TOKENS])
        merges = [m for m in MERGES if vocabulary != "llama-bpe" or m != ("Ġt", "he")]
        writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_tokenizer_pre("llama-bpe" if vocabulary == "llama-bpe" else "default")
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray,
                ggml_type: gguf.GGMLQuantizationType) -> None:
    if values.ndim == 1 or ggml_type == F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif ggml_type == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif ggml_type == gguf.GGMLQuantizationType.Q1_0:
        writer.add_tensor(name, quantize_q1_0(values), raw_dtype=ggml_type)
    elif ggml_type in GGUF_HALF_FIELDS and ggml_type not in QUANTIZABLE:
        blocks = random_blocks(ggml_type, math.prod(values.shape[:-1]), values.shape[-1])
        writer.add_tensor(name, blocks.reshape(*values.shape[:-1], -1), raw_dtype=ggml_type)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, ggml_type), raw_dtype=ggml_type)


def quantize_q1_0(values: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q1_0_ref (the gguf package has no Q1_0): per 128 weights the float16
    mean of |w| as d, then each weight's sign as one bit (set for w >= 0), least significant first."""
    blocks = values.astype(np.float32).reshape(*values.shape[:-1], -1, 128)
    scales = np.abs(blocks).mean(axis=-1, keepdims=True).astype(np.float16).view(np.uint8)
    bits = np.packbits(blocks >= 0, axis=-1, bitorder="little")
    return np.concatenate([scales, bits], axis=-1).reshape(*values.shape[:-1], -1)


def _gguf_name(hf_name: str, arch: str) -> str:
    module, _, leaf = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    _, _, layer, part = module.split(".", 3)
    names = {**_LAYER, **_GEMMA3_LAYER} if arch == "gemma3" else _LAYER
    return f"blk.{layer}.{names[part]}.{leaf}"


def _llama_cpp_order(values: np.ndarray, name: str, config: transformers.PretrainedConfig, arch: str) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, applied to q and k weights and biases (llama, and
    SmolLM3Model and GraniteModel, LlamaModels)."""
    if arch not in ("llama", "smollm3", "granite") or not (".q_proj." in name or ".k_proj." in name):
        return values
    heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    shape = values.shape
    return values.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _llama3_rope_factors(config: transformers.PretrainedConfig) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for llama3 scaling: the divisor of each frequency."""
    rope = config.rope_parameters
    dim = _head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_context_len = rope["original_max_position_embeddings"]
    low_wavelen = old_context_len / rope["low_freq_factor"]
    high_wavelen = old_context_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)
