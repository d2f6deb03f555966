"""Tiny random models of each supported kind, a matching byte-level tokenizer, and a driver
that runs a vivace model step by step over a paged KV cache with scattered blocks."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from vivace.layers.attention import AttentionMetadata
from vivace.models.config import ModelConfig
from vivace.models.llama import kv_cache_shape

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("e", "ll"), ("o", "r")]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE: the 256 byte symbols, the merged pieces, then the specials.
TOKENS = [bytes_to_unicode()[b] for b in range(256)] + ["".join(m) for m in MERGES] + SPECIAL_TOKENS
BOS_ID, EOS_ID = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_COMMON = dict(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# Phi-4-mini's rope at tiny size: 12 of 16 dims rotating, LongRoPE past 32 positions, its factors
# exact in float32 (as a GGUF stores them).
PHI3_LONGROPE = dict(partial_rotary_factor=0.75, original_max_position_embeddings=32, rope_theta=10000.0,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.125, 1.25, 1.5, 2.0, 2.5],
                                   "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]})
# llama.cpp's layout (5 sliding layers, 1 global, 1 sliding), two rope bases, head_dim apart from
# hidden/heads, and llama.cpp's attention scale (1/sqrt(head_dim)), so that a GGUF export holds it all.
GEMMA3 = dict(num_hidden_layers=7, hidden_size=32, intermediate_size=48, head_dim=32, query_pre_attn_scalar=32,
              sliding_window=6, tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=1e4)
# Granite 3.x's four multipliers at non-trivial values (granite-3.3-2b's, but the residual one's
# 0.22 and logits' 8), embeddings tied as in the 2B.
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0,
               tie_word_embeddings=True)
KINDS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, num_key_value_heads=1)),
    # A head size the native decode kernel is not built for (tiny test checkpoints have heads of 4 to 24).
    "llama_head24": (transformers.LlamaConfig, dict(hidden_size=96, num_attention_heads=4)),
    # theta 10000 over head_dim 16 puts wavelengths on both sides of and between 32/4 and 32/1.
    "llama3_rope": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3_ROPE, rope_theta=10000.0)),
    "linear_rope": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1e6)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=32)),
    # Windows shorter than the test prompts, and not a multiple of the block size.
    "mistral_sliding": (transformers.MistralConfig, dict(sliding_window=7)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32, rope_theta=1e6)),
    "phi3": (transformers.Phi3Config, dict(sliding_window=9, pad_token_id=None)),
    "granite": (transformers.GraniteConfig, GRANITE),
    "gemma3": (transformers.Gemma3TextConfig, GEMMA3),
    # gemma-3-4b/12b/27b's rope: linear scaling on the global layers only (a GGUF carries it too).
    "gemma3_linear_rope": (transformers.Gemma3TextConfig,
                           dict(GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # Transformers-only choices a GGUF can't carry: an attention scale apart from head_dim, pattern 2.
    "gemma3_pattern2": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=6, sliding_window_pattern=2,
        tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=1e4)),
}


# Mixtures of experts (tests/models/test_moe.py): 8 experts, 2 a token. Qwen3-MoE's middle layer
# is a dense MLP (mlp_only_layers), wider than its experts; its weights renormalized, as in the
# released models and as llama.cpp always runs them.
MOE_KINDS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=3, head_dim=32, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                 rope_theta=1e6)),
}


def tiny_config(kind: str, **overrides: object) -> transformers.PretrainedConfig:
    config_class, extra = KINDS[kind] if kind in KINDS else MOE_KINDS[kind]
    # A copy: transformers adds keys to the rope dict it is given.
    return config_class(**copy.deepcopy({**_COMMON, **extra, **overrides}))


def tiny_model(kind: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """A random model (``overrides`` change its config), as ``random_model`` makes it."""
    return random_model(tiny_config(kind, **overrides), seed)


def random_model(config: transformers.PretrainedConfig, seed: int = 0,
                 auto_class: type = transformers.AutoModelForCausalLM) -> transformers.PreTrainedModel:
    """A random model of ``config`` (made by ``auto_class``) whose every weight (norms and biases too)
    is non-trivial and exactly representable in float16, so an F16 export is lossless."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.1)
            param.copy_(param.half().float())
    return model


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=TOKENS[BOS_ID], eos_token=TOKENS[EOS_ID], chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tokenizer


def save_hf_dir(model: transformers.PreTrainedModel, out: Path, **save_kwargs: object) -> Path:
    model.save_pretrained(out, **save_kwargs)
    tiny_tokenizer().save_pretrained(out)
    return out


@torch.no_grad()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(token_ids), vocab]`` for one sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(TOKENS), (length,), generator=generator).tolist()


@dataclass
class PagedRun:
    """Drives a vivace model through steps of a flat batch. Blocks are handed out in a
    shuffled order, so no sequence's blocks are contiguous."""

    model: torch.nn.Module
    config: ModelConfig
    block_size: int = 4
    num_blocks: int = 64

    def __post_init__(self) -> None:
        shape = kv_cache_shape(self.config, self.num_blocks, self.block_size)
        dtype = self.model.embed_tokens.weight.dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(self.config.num_hidden_layers)]
        self.free_blocks = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each sequence its next tokens; return each one's logits ``[len(chunk), vocab]``."""
        input_ids, positions, slots = [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(tokens):
                table.append(self.free_blocks.pop())
            for pos in range(start, start + len(tokens)):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, start + len(tokens))
            self.lengths[seq] = start + len(tokens)
        width = max(len(self.tables[seq]) for seq in chunks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_lens=[len(t) for t in chunks.values()],
            seq_lens=[self.lengths[seq] for seq in chunks], block_size=self.block_size,
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]))
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden).split(meta.query_lens)
        return dict(zip(chunks, logits))
