"""What vivace needs to know about a model, read once from a Hugging Face config."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import transformers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# "freq_factors" is llama.cpp's form of llama3 scaling: per-frequency divisors stored in the GGUF.
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. ``rope_scaling`` is None for plain RoPE,
    else a dict with ``rope_type`` in ``ROPE_TYPES`` and that type's parameters."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False  # bias on the output projection (Llama's attention_bias=True)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            hint = (" (its frequencies depend on the longest sequence in the batch, so logits would "
                    "depend on batch composition)" if rope_type == "dynamic" else "")
            raise ValueError(f"unsupported rope scaling {rope_type!r}{hint}; supported: {', '.join(ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, config: dict[str, Any] | transformers.PretrainedConfig) -> ModelConfig:
        """Build from a ``config.json`` dict or a transformers config.

        Raises ValueError for an unsupported architecture (naming the supported ones) or a
        feature vivace does not implement (active sliding window, non-SiLU MLP, MLP bias,
        partial rotary, dynamic RoPE).
        """
        if isinstance(config, dict):
            config = _to_transformers_config(config)
        architecture = _architecture(config.architectures, config.model_type)
        _check_supported_features(config)
        theta, scaling = _rope(config)
        eos = config.eos_token_id
        attention_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=architecture != "Qwen2ForCausalLM" and attention_bias,
            bos_token_id=config.bos_token_id,
            eos_token_ids=_as_tuple(eos),
        )


def _to_transformers_config(config: dict[str, Any]) -> transformers.PretrainedConfig:
    """Let transformers fill defaults and normalize old key spellings, after checking the architecture."""
    config = copy.deepcopy(config)  # transformers edits nested dicts (rope) in place
    model_type = config.pop("model_type", None)
    architecture = _architecture(config.get("architectures"), model_type)
    model_type = model_type or next(t for t, a in _MODEL_TYPES.items() if a == architecture)
    return transformers.AutoConfig.for_model(model_type, **config)


def _architecture(architectures: list[str] | None, model_type: str | None) -> str:
    architecture = (architectures or [_MODEL_TYPES.get(model_type or "", repr(model_type))])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def _check_supported_features(config: transformers.PretrainedConfig) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")
    if getattr(config, "mlp_bias", False):
        raise ValueError("unsupported mlp_bias=True")
    if _uses_sliding_window(config):
        raise ValueError(f"unsupported sliding window attention (sliding_window={config.sliding_window} < "
                         f"max_position_embeddings={config.max_position_embeddings}); "
                         "set sliding_window to null in config.json to serve it with full attention")


def _uses_sliding_window(config: transformers.PretrainedConfig) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return False
    if config.model_type == "qwen2":  # Qwen2 windows only layers from max_window_layers on, if enabled
        return bool(config.use_sliding_window) and config.max_window_layers < config.num_hidden_layers
    return True


def _rope(config: transformers.PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from transformers 5's ``rope_parameters`` or 4's ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1")
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    return theta, {**params, "rope_type": rope_type}


def _as_tuple(token_ids: int | list[int] | None) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    return (token_ids,) if isinstance(token_ids, int) else tuple(token_ids)
