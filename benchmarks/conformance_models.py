"""Tiny random Hugging Face models for ``llama_cpp_conformance.py``: one per family vivace serves, each
with the features that set real checkpoints apart (tied or untied embeddings, attention biases, q/k
norms, head_dim apart from hidden/heads, GQA, llama3 / YaRN / LongRoPE scaling, sliding windows,
partial rotary, experts), hidden size 256 so that llama-quantize's K-quants apply to every matrix, and
SmolLM2's real tokenizer (from the default model's GGUF), which convert_hf_to_gguf.py recognizes."""

from __future__ import annotations

import copy
import json
import shutil
import zlib
from pathlib import Path

import torch
import transformers

from vivace.models.gguf import open_gguf
from vivace.models.loader import default_model_path

_COMMON = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
PHI3 = dict(partial_rotary_factor=0.75, sliding_window=None, pad_token_id=None, max_position_embeddings=16384,
            original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling={
                "rope_type": "longrope", "short_factor": [1.0 + i / 16 for i in range(24)],
                "long_factor": [1.5 + i / 4 for i in range(24)]})
# family -> (config class, overrides, the GGUF asks for a BOS (tokenizer.ggml.add_bos_token))
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}, rope_theta=500000.0), True),
    "llama_tied_bias": (transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True,
                                                       num_key_value_heads=1), False),
    "mistral": (transformers.MistralConfig, dict(head_dim=128, sliding_window=None, rope_theta=1e6), True),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}), False),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=128, rope_theta=1e6), False),
    # Phi-4-mini's rope (3/4 of each head rotating, LongRoPE) without a window, and with a short one
    # (llama.cpp turns Phi-3's windows off: transformers and vivace keep them).
    "phi3": (transformers.Phi3Config, PHI3, False),
    "phi3_window": (transformers.Phi3Config, {**PHI3, "sliding_window": 16}, False),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=6, head_dim=128, query_pre_attn_scalar=128, sliding_window=8, tie_word_embeddings=True,
        rope_theta=1e6, rope_local_base_freq=1e4), False),
    "smollm3": (transformers.SmolLM3Config, dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=None),
                False),
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                 attention_multiplier=0.015625, logits_scaling=0.5,
                                                 tie_word_embeddings=True), False),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
        rope_theta=1e6), False),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
                                                 rope_theta=1e6), False),
}
WEIGHT_STD = 0.12  # random weights this large make sharp, non-flat next-token distributions
# transformers 5 picks these model types' own tokenizer classes whatever tokenizer.json says, and the
# converter then hashes a Qwen or Gemma pre-tokenizer over SmolLM2's vocabulary: their saved config.json
# says llama (the converter picks its model class by "architectures", not by "model_type").
_OWN_TOKENIZER_CLASS = ("qwen2", "qwen3_moe", "gemma3_text")
# The converter reads Phi-3's vocabulary from tokenizer.model (SentencePiece) unless the class is GPT-2's, as
# Phi-4-mini's is.
_TOKENIZER_CLASS = {"phi3": "GPT2Tokenizer"}
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<reponame>", "<|im_start|>")  # turn ends, a FIM one, a control token


def smollm2_tokenizer(out: Path) -> Path:
    """SmolLM2's tokenizer files (tokenizer.json, its config, chat template), read from the default GGUF,
    with the released tokenizer.json's pre-tokenizer (digits split one by one, then byte-level), which
    transformers' GGUF reader leaves out."""
    if not (out / "tokenizer.json").exists():
        path = default_model_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(out)
        backend = json.loads((out / "tokenizer.json").read_text())
        backend["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, backend["pre_tokenizer"]]}
        (out / "tokenizer.json").write_text(json.dumps(backend))
    return out


def build_model(family: str, out: Path) -> tuple[Path, transformers.PreTrainedModel, list[int]]:
    """The family's random model saved under ``out/hf`` (weights exact in both float16 and bfloat16, so
    F16 and BF16 files hold them losslessly), the model, and the ids of ``END_TOKENS``."""
    config_class, overrides, _ = FAMILIES[family]
    config = config_class(**{**_COMMON, **overrides})
    torch.manual_seed(zlib.crc32(family.encode()))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf_dir = out / "hf"
    if (hf_dir / "model.safetensors").exists():  # made before: read back as transformers reads it
        saved = type(model).from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()
        return hf_dir, saved, _end_tokens(hf_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name
            param.normal_(0.0 if is_norm and family == "gemma3" else float(is_norm), 0.2 if is_norm else WEIGHT_STD)
            param.copy_(param.bfloat16().half().float())
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_tokenizer(out.parent / "smollm2-tokenizer") / name, hf_dir / name)
    if config.model_type in _TOKENIZER_CLASS:
        saved = json.loads((hf_dir / "tokenizer_config.json").read_text())
        saved["tokenizer_class"] = _TOKENIZER_CLASS[config.model_type]
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(saved, indent=1))
    if config.model_type in _OWN_TOKENIZER_CLASS:
        saved = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**saved, "model_type": "llama"}, indent=1))
    return hf_dir, model, _end_tokens(hf_dir)


def _end_tokens(hf_dir: Path) -> list[int]:
    added = json.loads((hf_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in added}
    return [ids[text] for text in END_TOKENS]


@torch.no_grad()
def hf_logprobs(model: transformers.PreTrainedModel, prompt: list[int], continuation: list[int],
                top_k: int) -> list[dict[int, float]]:
    """transformers' float32 top-``top_k`` logprobs at each continuation position, teacher-forced."""
    logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    top = logprobs.topk(top_k)
    return [dict(zip(ids.tolist(), values.tolist())) for values, ids in zip(top.values, top.indices)]


def dequantized_model(model: transformers.PreTrainedModel, path: Path) -> transformers.PreTrainedModel:
    """``model`` with the weights of GGUF ``path`` dequantized (gguf-py's dequantization, as llama.cpp's),
    the float32 reference for a quantized file. Raises ValueError for a weight it cannot place."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, values in open_gguf(path).tensors:
        if ".mlp.experts." in name:  # transformers 5 keeps an expert layer's gate and up as one [E, 2I, H]
            prefix, projection = name.split(".mlp.experts.")
            experts.setdefault(prefix, {})[projection.removesuffix(".weight")] = values
        else:
            state[name] = values
    for prefix, parts in experts.items():
        state[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
        state[f"{prefix}.mlp.experts.down_proj"] = parts["down_proj"]
    reference = copy.deepcopy(model)
    unexpected = reference.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"{path.name}: no place in {type(model).__name__} for {unexpected[:3]}")
    return reference
