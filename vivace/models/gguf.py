"""A llama.cpp GGUF model: config and tokenizer from its metadata, weights dequantized to
float32 under Hugging Face names and conventions: llama.cpp's rotary row permutation undone
(llama, smollm3 and granite archs), Gemma's stored ``1 + w`` norms back to ``w``."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
import transformers

from vivace.layers.rotary import longrope_attention_factor, yarn_attention_factor
from vivace.models.config import FULL, SLIDING, ModelConfig, MoeConfig, context_length
from vivace.models.gguf_file import GGUFFile

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "smollm3": "SmolLM3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                  "granite": "GraniteForCausalLM"}
# Architectures whose q/k rows convert_hf_to_gguf permutes for llama.cpp's GPT-J-style rope kernel
# (Mixtral is written as llama-arch; its GraniteModel is a LlamaModel).
_PERMUTED = ("LlamaForCausalLM", "SmolLM3ForCausalLM", "MixtralForCausalLM", "GraniteForCausalLM")
# Granite's scalars: ModelConfig field -> llama.cpp key (convert_hf_to_gguf writes those set).
_GRANITE_KEYS = {"embedding_multiplier": "{arch}.embedding_scale", "residual_multiplier": "{arch}.residual_scale",
                 "attention_multiplier": "{arch}.attention.scale", "logits_scaling": "{arch}.logit_scale"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's, and any architecture's from convert_hf_to_gguf --fuse-qkv
    # A mixture of experts' router and experts (one [num_experts, out, in] tensor a projection).
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Where an architecture's tensors differ from llama's names.
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # stored fused, as vivace runs it
}
# llama.cpp's Gemma 3 unless its keys say otherwise: every 6th layer global, sliding layers rotate with base 10000.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0
# llama.cpp's SmolLM3: every 4th layer rotates nothing (a fixed rule; no GGUF key says it).
_SMOLLM3_NO_ROPE_STEP = 4
# Expert keys llama.cpp reads, at the values that mean what transformers' Qwen3-MoE and Mixtral do.
_EXPERT_NEUTRAL = {"expert_shared_count": (0,), "expert_gating_func": (1,), "expert_weights_scale": (0.0, 1.0),
                   "expert_group_count": (0,)}
# Turn ends llama.cpp stops at (its end-of-generation tokens, found by text) besides the metadata's
# EOS and EOT: a chat GGUF's EOS is often the end of text while its template ends each turn with
# another control token (Gemma 3's <end_of_turn>, Phi-3's <|end|>, Llama 3's <|eom_id|>).
_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>", "<end_of_utterance>",
                      # Fill-in-the-middle pad, repository and file separators, which llama.cpp ends on too
                      # (SmolLM2's <reponame>, Qwen2.5's <|fim_pad|>, <|repo_name|> and <|file_sep|>).
                      "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                      "<reponame>", "<|file_sep|>")
# Keys naming those separators, which llama.cpp's tokenizer reads before it looks for their text.
_FIM_END_KEYS = tuple(f"tokenizer.ggml.fim_{kind}_token_id" for kind in ("pad", "rep", "sep"))
_CHAT_TEMPLATE = "tokenizer.chat_template"
_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
# Pre-tokenizers (tokenizer.ggml.pre) whose BPE llama.cpp runs with ignore_merges, as their tokenizer.json
# says (Llama 3, Mistral's Tekken): a word in the vocabulary is that token, whatever the merges would make.
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m")
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of llama3 rope scaling
_LONGROPE = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}  # Phi-3
_ROPE_TENSORS = (_ROPE_FREQS, *_LONGROPE.values())
# YaRN keys llama.cpp reads that transformers' YaRN has no counterpart of, with their neutral values.
_YARN_NEUTRAL = {"yarn_ext_factor": (-1.0, 1.0), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (0.0,),
                 "attn_factor": (1.0,)}


@dataclass
class GGUFModel:
    """An opened GGUF model. ``tensors`` yields ``(hf_name, float32 tensor)`` once, lazily (a
    tensor ``open_gguf`` was told to skip comes as a meta tensor of its shape)."""

    config: ModelConfig
    tokenizer: transformers.PreTrainedTokenizerFast
    tensors: Iterator[tuple[str, torch.Tensor]]


def open_gguf(path: Path, skip: Collection[str] = ()) -> GGUFModel:
    """Read ``path``'s config and tokenizer; weights are dequantized as ``tensors`` is consumed,
    but those named in ``skip`` (GGUF names; kept as blocks by the caller).

    Raises ValueError for an architecture other than those of ``_ARCHITECTURES``, missing metadata, an
    unsupported rope scaling (or partial rotary outside Phi-3), or a tensor it cannot place or dequantize.
    """
    file = GGUFFile(path)
    config = model_config(file)
    tokenizer = _tokenizer(path, file)
    config = dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, *_turn_ends(file, tokenizer, config)))
    return GGUFModel(config, tokenizer, _tensors(file, config, file.metadata["general.architecture"], frozenset(skip)))


def _turn_ends(file: GGUFFile, tokenizer: transformers.PreTrainedTokenizerFast, config: ModelConfig) -> list[int]:
    """The tokens of ``_END_OF_GENERATION`` the file has as added ones (control, or user-defined as some
    Gemma GGUFs mark <end_of_turn>: llama.cpp overrides that) and those ``_FIM_END_KEYS`` name, but for
    its EOS and EOT."""
    types = file.metadata.get("tokenizer.ggml.token_type") or []
    added = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    vocab = tokenizer.get_vocab()
    found = [vocab[text] for text in _END_OF_GENERATION if text in vocab]
    found = [i for i in found if i < len(types) and types[i] in added]
    named = [file.metadata[key] for key in _FIM_END_KEYS if key in file.metadata]
    return list(dict.fromkeys(i for i in found + named if i not in config.eos_token_ids))


def model_config(file: GGUFFile) -> ModelConfig:
    """The model's config from llama.cpp's metadata keys (``{arch}.embedding_length``, ...)."""
    arch = file.metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)} "
                         f"({', '.join(_ARCHITECTURES.values())})")

    def get(key: str, default: Any = None) -> Any:
        value = file.metadata.get(key.format(arch=arch), default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key.format(arch=arch)!r}")
        return value

    hidden, heads = get("{arch}.embedding_length"), get("{arch}.attention.head_count")
    layers, context = get("{arch}.block_count"), get("{arch}.context_length")
    head_dim = get("{arch}.attention.key_length", hidden // heads)
    rotary_dim = get("{arch}.rope.dimension_count", head_dim)
    scaling = _rope_scaling(file, arch, context)
    eos = [file.metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
    moe = _moe(file, arch, layers)
    architecture = "MixtralForCausalLM" if arch == "llama" and moe else _ARCHITECTURES[arch]
    config = ModelConfig(
        architecture=architecture,
        vocab_size=file.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("{arch}.feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=get("{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=float(get("{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=context_length(context, scaling, architecture),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors or "blk.0.attn_qkv.bias" in file.tensors,
        attention_out_bias="blk.0.attn_output.bias" in file.tensors,
        bos_token_id=file.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(token for token in eos if token is not None)),
        qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        moe=moe,
    )
    window = file.metadata.get(f"{arch}.attention.sliding_window")
    if arch == "phi3" and window and window < context:
        config = dataclasses.replace(config, sliding_window=window, layer_types=(SLIDING,) * layers)
    if arch == "gemma3":
        config = _gemma3(config, file, arch)
    if arch == "smollm3":
        nope = tuple(i for i in range(layers) if (i + 1) % _SMOLLM3_NO_ROPE_STEP == 0)
        config = dataclasses.replace(config, nope_layers=nope)
    if arch == "granite":
        config = dataclasses.replace(config, **{field: float(file.metadata[key.format(arch=arch)])
                                                for field, key in _GRANITE_KEYS.items()
                                                if key.format(arch=arch) in file.metadata})
    return config


def _moe(file: GGUFFile, arch: str, layers: int) -> MoeConfig | None:
    """The experts of a ``qwen3moe`` file, or of a ``llama`` one with ``expert_count`` (Mixtral), as
    llama.cpp runs them: softmax routing, the chosen weights renormalized, each expert
    ``expert_feed_forward_length`` wide (Mixtral: ``feed_forward_length``); a layer without a
    router (``ffn_gate_inp``) is dense. Raises ValueError for llama.cpp's other expert variants."""
    count = file.metadata.get(f"{arch}.expert_count", 0)
    if not count:
        if arch == "qwen3moe":
            raise ValueError(f"GGUF metadata lacks '{arch}.expert_count'")
        return None
    for key, neutral in _EXPERT_NEUTRAL.items():
        if file.metadata.get(f"{arch}.{key}", neutral[0]) not in neutral:
            raise ValueError(f"unsupported GGUF '{arch}.{key}' = {file.metadata[f'{arch}.{key}']} "
                             "(vivace's experts: softmax routing, no shared experts, no weight scale)")
    shared = sorted({name.split(".")[2] for name in file.tensors if "shexp" in name})
    if shared:
        raise ValueError(f"unsupported GGUF shared experts ({', '.join(shared)}); vivace runs routed experts only")
    size = file.metadata.get(f"{arch}.expert_feed_forward_length") or file.metadata[f"{arch}.feed_forward_length"]
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors)
    return MoeConfig(count, file.metadata[f"{arch}.expert_used_count"], size, True, dense)


def _gemma3(config: ModelConfig, file: GGUFFile, arch: str) -> ModelConfig:
    """Gemma 3's extras as llama.cpp reads them: its sliding layers (``attention.sliding_window_pattern``,
    one flag a layer or a period whose last layer is global, 6 when absent; none without a window), the
    local rope base, the final logit soft-capping when the file has one, and the attention scale
    (1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 62-layer 27B)."""
    layers = config.num_hidden_layers
    scalar = config.hidden_size // config.num_attention_heads if layers == 62 else config.head_dim
    config = dataclasses.replace(config, query_pre_attn_scalar=scalar,
                                 final_logit_softcapping=file.metadata.get(f"{arch}.final_logit_softcapping") or None)
    window = file.metadata.get(f"{arch}.attention.sliding_window")
    if not window:
        return config
    pattern = file.metadata.get(f"{arch}.attention.sliding_window_pattern", _GEMMA3_PATTERN)
    sliding = ([bool(flag) for flag in pattern] if isinstance(pattern, list)
               else [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
    if not any(sliding):
        return config
    local_theta = float(file.metadata.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    layer_types = tuple(SLIDING if flag else FULL for flag in sliding)
    return dataclasses.replace(config, sliding_window=window, layer_types=layer_types, local_rope_theta=local_theta)


def _rope_scaling(file: GGUFFile, arch: str, context: int) -> dict[str, Any] | None:
    """``ModelConfig.rope_scaling`` from llama.cpp's keys: none, linear, YaRN (``rope.scaling.type``),
    llama3 as ``rope_freqs`` tensor, Phi-3's LongRoPE as its two factor tensors."""
    rope_type = file.metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = file.metadata.get(f"{arch}.rope.scaling.factor") or file.metadata.get(f"{arch}.rope.scale_linear")
    if rope_type == "none" and factor not in (None, 1.0):
        rope_type = "linear"
    tensors = [name for name in _ROPE_TENSORS if name in file.tensors]
    if tensors and rope_type != "none":
        raise ValueError(f"GGUF has both {tensors[0]} and {rope_type} rope scaling")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if rope_type == "yarn":
        return _yarn(file, arch, factor)
    if rope_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling {rope_type!r}; supported: none, linear, yarn")
    if not tensors:
        return None
    if tensors == [_ROPE_FREQS]:
        factors = file.dequantize(file.tensors[_ROPE_FREQS])
        return {"rope_type": "freq_factors", "freq_factors": tuple(factors.tolist())}
    if tensors != list(_LONGROPE.values()):
        raise ValueError(f"GGUF rope factor tensors {tensors} are neither {_ROPE_FREQS} "
                         f"nor {' and '.join(_LONGROPE.values())}")
    return _longrope(file, arch, context)


def _longrope(file: GGUFFile, arch: str, context: int) -> dict[str, Any]:
    """Phi-3's LongRoPE as convert_hf_to_gguf writes it: the factors as tensors, the attention
    factor (else LongRoPE's default for ``context``) and the original context as keys."""
    original = file.metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"GGUF metadata lacks '{arch}.rope.scaling.original_context_length' (LongRoPE)")
    attention_factor = file.metadata.get(f"{arch}.rope.scaling.attn_factor")
    if attention_factor is None:
        attention_factor = longrope_attention_factor(context / original, original)
    factors = {key: tuple(file.dequantize(file.tensors[name]).tolist()) for key, name in _LONGROPE.items()}
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


def _yarn(file: GGUFFile, arch: str, factor: float | None) -> dict[str, Any]:
    """YaRN from ``rope.scaling.factor``, ``.original_context_length`` and ``.yarn_beta_fast``/``_slow``,
    as transformers computes it (llama.cpp's corrections are truncated, its attention factor
    transformers' default). Raises ValueError for llama.cpp's other YaRN keys at other values."""
    key = f"{arch}.rope.scaling."
    original = file.metadata.get(key + "original_context_length")
    if not factor or original is None:
        raise ValueError(f"GGUF YaRN needs '{key}factor' and '{key}original_context_length'")
    for name, neutral in _YARN_NEUTRAL.items():
        if file.metadata.get(key + name, neutral[0]) not in neutral:
            raise ValueError(f"unsupported GGUF YaRN '{key}{name}' = {file.metadata[key + name]}")
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
            "beta_fast": float(file.metadata.get(key + "yarn_beta_fast", 32.0)),
            "beta_slow": float(file.metadata.get(key + "yarn_beta_slow", 1.0)),
            "truncate": True, "attention_factor": yarn_attention_factor(factor)}


def _tokenizer(path: Path, file: GGUFFile) -> transformers.PreTrainedTokenizerFast:
    """The file's tokenizer with its chat template; with named ones (``tokenizer.chat_template.<name>``,
    Hermes-2-Pro's "tool_use"), all of them by name, as transformers reads tokenizer_config.json's."""
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    _prefix_space_as_sentencepiece(tokenizer, file)
    if file.metadata.get("tokenizer.ggml.pre") in _IGNORE_MERGES:  # a word the vocabulary holds is one token
        tokenizer.backend_tokenizer.model.ignore_merges = True
    default = tokenizer.chat_template or file.metadata.get(_CHAT_TEMPLATE)
    named = {key.removeprefix(f"{_CHAT_TEMPLATE}."): value for key, value in file.metadata.items()
             if key.startswith(f"{_CHAT_TEMPLATE}.")}
    tokenizer.chat_template = {**({"default": default} if default else {}), **named} if named else default
    return tokenizer


def _prefix_space_as_sentencepiece(tokenizer: transformers.PreTrainedTokenizerFast, file: GGUFFile) -> None:
    """A SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Llama 2, Mistral 7B, TinyLlama) gets
    its dummy prefix space as llama.cpp and SentencePiece give it: before the text and after every special
    token, whatever the text starts with (" Hi" is "▁▁Hi", "</s>\n" is "</s>▁\n"), and none at all when
    ``tokenizer.ggml.add_space_prefix`` is false (nor a first space taken off when decoding). transformers'
    Metaspace ("first") adds it only at the input's start, and not before a space, whatever the key says."""
    backend = tokenizer.backend_tokenizer
    if (file.metadata.get("tokenizer.ggml.model") != "llama"
            or not isinstance(backend.pre_tokenizer, tokenizers.pre_tokenizers.Metaspace)):
        return
    normalizers = tokenizers.normalizers
    space_prefix = [normalizers.Prepend("\u2581")] if file.metadata.get(_ADD_SPACE_PREFIX, True) else []
    backend.normalizer = normalizers.Sequence([*space_prefix, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    if not space_prefix:
        decoders = tokenizers.decoders
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])


def _tensors(file: GGUFFile, config: ModelConfig, arch: str,
             skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, info in file.tensors.items():
        if name in _ROPE_TENSORS:
            continue
        hf_name = _hf_name(name, arch)
        if name in skip:
            yield hf_name, torch.empty(info.shape, device="meta")
            continue
        values = hf_rows(file.dequantize(info), name, config)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            values = values - 1.0  # llama.cpp stores Gemma's RMSNorm factor 1 + w
        yield hf_name, torch.from_numpy(values)


def hf_rows(values: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    """Rows of GGUF tensor ``name`` (float values or block bytes, one row per output) in Hugging
    Face order: llama.cpp permutes the q/k rows of llama-arch models (Llama, Mistral, Mixtral) and
    smollm3 only, within a fused ``attn_qkv`` (``--fuse-qkv``: q, k, v stacked) too."""
    rotary_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    part = name.split(".")[-2]
    if config.architecture not in _PERMUTED:
        return values
    if part in rotary_heads:
        return _unpermute(values, rotary_heads[part])
    if part == "attn_qkv":
        q_end = config.num_attention_heads * config.head_dim
        k_end = q_end + config.num_key_value_heads * config.head_dim
        return np.concatenate([_unpermute(values[:q_end], config.num_attention_heads),
                               _unpermute(values[q_end:k_end], config.num_key_value_heads), values[k_end:]])
    return values


def _unpermute(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` of q/k rows (weights and biases): within each
    head it interleaves the two rotary halves (row ``half * d + i`` goes to ``2 * i + half``)
    for llama.cpp's GPT-J-style rope kernel."""
    shape = values.shape
    return values.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of GGUF tensor ``name`` in a model of architecture ``arch``."""
    base, _, leaf = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        mapped = f"model.layers.{layer}.{names[part]}" if part in names else None
    else:
        mapped = _GLOBAL_NAMES.get(base)
    if mapped is None:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"{mapped}.{leaf}"
