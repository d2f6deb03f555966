"""What vivace needs to know about a model, read once from a Hugging Face config."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers

from vivace.layers.rotary import longrope_attention_factor, yarn_attention_factor
from vivace.models.multimodal import MULTIMODAL_TYPES, text_config

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM", "ministral": "MinistralForCausalLM", "ministral3": "Ministral3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "granite": "GraniteForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
_CONFIG_TYPES = {**_MODEL_TYPES, **MULTIMODAL_TYPES}  # what a config.json may name
_SUPPORTED = f"{', '.join(SUPPORTED_ARCHITECTURES)}; for their text, {', '.join(MULTIMODAL_TYPES.values())}"
SLIDING, FULL = "sliding_attention", "full_attention"
NOPE = "no_rope"  # the rotary table of a layer that rotates nothing (SmolLM3's NoPE layers): cos 1, sin 0
# "freq_factors" is llama.cpp's form of llama3 scaling: per-frequency divisors stored in the GGUF.
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope", "yarn")
_ACTIVATIONS = {"Gemma3ForCausalLM": "gelu_pytorch_tanh"}  # every other architecture: "silu"
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward of a mixture-of-experts model (``vivace.models.moe``): each token
    goes to ``top_k`` of ``num_experts`` SiLU-gated experts of ``intermediate_size``, weighted by
    its router's softmax (renormalized over the chosen ones with ``norm_topk_prob``). The layers
    of ``dense_layers`` have a dense MLP of the model's ``intermediate_size`` instead (Qwen3-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"a mixture of experts routes each token to 1 to num_experts ({self.num_experts}) "
                             f"experts, not {self.top_k}")

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder of the supported families. ``rope_scaling`` is None for
    plain RoPE, else a dict with ``rope_type`` in ``ROPE_TYPES`` and that type's parameters
    (``vivace.layers.rotary.inverse_frequencies``); LongRoPE's and YaRN's carry their resolved
    ``attention_factor``. ``rotary_dim`` is set when only the first dims of each head rotate
    (Phi-4-mini's ``partial_rotary_factor``; ``vivace.models.partial_rotary``).

    ``layer_types`` lists each layer's attention, ``"full_attention"`` or ``"sliding_attention"``
    (the last ``sliding_window`` positions, the query's own included); empty means all full.
    Sliding layers rotate with ``local_rope_theta`` (unscaled) when it is set (Gemma 3). Layers in
    ``nope_layers`` apply no rotary at all (SmolLM3); ``rope_type`` says which table a layer takes.
    ``query_temperature`` ``(beta, period)`` scales the rotated queries at position ``p`` by
    ``1 + beta * log(1 + floor(p / period))`` (Ministral 3's ``llama_4_scaling_beta``;
    ``vivace.layers.rotary.query_temperature``).

    Granite's four scalars (defaults: none of them): embeddings times ``embedding_multiplier``,
    each block's attention and MLP outputs times ``residual_multiplier`` before they join the
    residual stream, ``attention_multiplier`` as the softmax scale, logits divided by
    ``logits_scaling``. The model applies them without a kernel of its own
    (``vivace.models.llama.LlamaForCausalLM``): it carries the residual stream divided by
    ``residual_multiplier`` (``embed_scale``, ``residual_norm_eps``) and divides the final norm's
    weight by ``logits_scaling`` at load.
    """

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
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotation (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma 3), else head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2 style)
    rotary_dim: int | None = None  # dims of each head that rotate (the first ones); None: all
    nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3)
    query_temperature: tuple[float, int] | None = None  # (beta, period) of Llama 4's query scaling
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts architecture; None: dense
    embedding_multiplier: float = 1.0  # Granite's four scalars (docstring)
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale itself (Granite); see attention_scale
    logits_scaling: float = 1.0

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
        self._check_rotary_dim()
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"{self.architecture} {'needs' if self.moe is None else 'has no'} experts (moe)")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_hidden_layers}")
        if set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"unsupported layer types {sorted(set(self.layer_types) - {SLIDING, FULL})}; "
                             f"supported: {FULL}, {SLIDING}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if not set(self.nope_layers) <= set(range(self.num_hidden_layers)):
            raise ValueError(f"nope_layers {self.nope_layers} name layers the model lacks "
                             f"(it has {self.num_hidden_layers})")
        if min(self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) <= 0:
            raise ValueError(f"unsupported multipliers: embedding {self.embedding_multiplier}, residual "
                             f"{self.residual_multiplier}, logits scaling {self.logits_scaling} (all must be > 0)")
        if self.query_temperature and self.qk_norm:  # the CUDA forward scales queries before their norm
            raise ValueError("unsupported query temperature (llama_4_scaling_beta) with q/k norms")

    def _check_rotary_dim(self) -> None:
        if self.rotary_dim is None:
            return
        if self.architecture != "Phi3ForCausalLM":
            raise ValueError(f"unsupported partial rotary ({self.rotary_dim} of {self.head_dim} dims) for "
                             f"{self.architecture}; supported for Phi3ForCausalLM only")
        if not 0 < self.rotary_dim < self.head_dim or self.rotary_dim % 2 or self.head_dim % 2:
            raise ValueError(f"unsupported partial rotary: {self.rotary_dim} of {self.head_dim} dims "
                             "(both must be even, the rotary ones fewer)")

    def served_with(self, max_model_len: int | None) -> ModelConfig:
        """This config serving at most ``max_model_len`` positions (None: as many as the model has):
        ``max_position_embeddings`` becomes the served context, which sizes the rotary tables and
        picks LongRoPE's factors (long ones only when it exceeds the original context). Raises
        ValueError when ``max_model_len`` is more than the model's context, as vLLM refuses it."""
        if max_model_len is not None and max_model_len > self.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_model_len} is more than the model's context length "
                             f"({self.max_position_embeddings}, its max_position_embeddings or GGUF context_length)")
        if max_model_len is None or max_model_len == self.max_position_embeddings:
            return self
        return dataclasses.replace(self, max_position_embeddings=max_model_len)

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else None

    def rope_type(self, layer: int) -> str:
        """The rotary table ``layer`` rotates q and k with: ``NOPE`` for none, ``SLIDING`` for a
        sliding layer with its own base (Gemma 3), else ``FULL``."""
        if layer in self.nope_layers:
            return NOPE
        return SLIDING if self.window(layer) is not None and self.local_rope_theta else FULL

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``attention_multiplier`` (Granite), else ``query_pre_attn_scalar ** -0.5``
        (Gemma 3), else ``head_dim ** -0.5``."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def residual_norm_eps(self) -> float:
        """The epsilon of the norms over the residual stream as vivace carries it, divided by
        ``residual_multiplier`` r: ``rms_norm(x / r, eps / r**2) == rms_norm(x, eps)``, so the blocks'
        outputs join the stream unscaled, whatever form (float, quantized, GGUF blocks) their
        projections take."""
        return self.rms_norm_eps / self.residual_multiplier ** 2

    @classmethod
    def from_hf(cls, config: dict[str, Any] | transformers.PretrainedConfig) -> ModelConfig:
        """Build from a ``config.json`` dict or a transformers config; of a multimodal wrapper
        (``vivace.models.multimodal``), its text model's.

        Raises ValueError for an unsupported architecture (naming the supported ones) or a
        feature vivace does not implement (another activation, MLP bias, partial rotary outside
        Phi-3, dynamic RoPE, attention logit soft-capping).
        """
        if isinstance(config, dict):
            config = _to_transformers_config(config)
        config = text_config(config)
        architecture = _architecture(config.architectures, config.model_type)
        _check_supported_features(config, architecture)
        theta, scaling, local_theta, partial_rotary_factor = _rope(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        window, layer_types = _sliding_layers(config)
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=context_length(config.max_position_embeddings, scaling, architecture),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=architecture != "Qwen2ForCausalLM" and attention_bias,
            bos_token_id=config.bos_token_id,
            eos_token_ids=_as_tuple(config.eos_token_id),
            sliding_window=window,
            layer_types=layer_types,
            local_rope_theta=local_theta,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            rotary_dim=None if partial_rotary_factor == 1.0 else int(head_dim * partial_rotary_factor),
            nope_layers=_nope_layers(config),
            query_temperature=_query_temperature(config, architecture),
            moe=_moe(config, architecture),
            **_granite_multipliers(config, architecture),
        )


def _to_transformers_config(config: dict[str, Any]) -> transformers.PretrainedConfig:
    """Let transformers fill defaults and normalize old key spellings, after checking the architecture."""
    config = copy.deepcopy(config)  # transformers edits nested dicts (rope) in place
    model_type = config.pop("model_type", None)
    architecture = _architecture(config.get("architectures"), model_type)
    model_type = model_type or next(t for t, a in _CONFIG_TYPES.items() if a == architecture)
    rope = config.get("rope_scaling")
    if isinstance(rope, dict) and "su" in (rope.get("type"), rope.get("rope_type")):  # LongRoPE's first name
        config["rope_scaling"] = {**rope, "type": "longrope", "rope_type": "longrope"}
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except KeyError as exc:  # transformers' check of the rope parameters a rope type needs
        raise ValueError(f"invalid config: {exc.args[0]}") from None


def _architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """The architecture a config names: one of ``SUPPORTED_ARCHITECTURES`` or a multimodal wrapper."""
    architecture = (architectures or [_CONFIG_TYPES.get(model_type or "", repr(model_type))])[0]
    if architecture not in _CONFIG_TYPES.values():
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {_SUPPORTED}")
    return architecture


def _check_supported_features(config: transformers.PretrainedConfig, architecture: str) -> None:
    activation = _ACTIVATIONS.get(architecture, "silu")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", activation)
    if act != activation:
        raise ValueError(f"unsupported activation {act!r} for {architecture}; only {activation!r} is implemented")
    if getattr(config, "mlp_bias", False):
        raise ValueError("unsupported mlp_bias=True")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("unsupported attn_logit_softcapping (Gemma 2); Gemma 3 has none")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("unsupported use_bidirectional_attention=True (an encoder, not a causal LM)")


def _granite_multipliers(config: transformers.PretrainedConfig, architecture: str) -> dict[str, float]:
    """Granite's ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` and
    ``logits_scaling``, those its config has (transformers' has all four); none for another
    architecture, whose transformers model ignores keys of those names."""
    if architecture != "GraniteForCausalLM":
        return {}
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {name: float(getattr(config, name)) for name in names if getattr(config, name, None) is not None}


def _moe(config: transformers.PretrainedConfig, architecture: str) -> MoeConfig | None:
    """The experts of a Mixtral (every layer sparse, weights renormalized) or Qwen3-MoE config
    (a layer is dense when ``mlp_only_layers`` lists it or ``decoder_sparse_step`` skips it)."""
    if architecture == "MixtralForCausalLM":
        return MoeConfig(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)
    if architecture != "Qwen3MoeForCausalLM":
        return None
    step, dense_only = config.decoder_sparse_step, set(config.mlp_only_layers)
    dense = tuple(i for i in range(config.num_hidden_layers) if i in dense_only or (i + 1) % step)
    return MoeConfig(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                     bool(config.norm_topk_prob), dense)


def _sliding_layers(config: transformers.PretrainedConfig) -> tuple[int | None, tuple[str, ...]]:
    """``(window, layer_types)``: transformers' ``layer_types`` where the config has them (Qwen2/3
    compute them from ``use_sliding_window`` and ``max_window_layers``, Gemma 3 from its pattern),
    else every layer sliding when ``sliding_window`` is set (Mistral, Phi-3). A window at least
    the context length is full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return None, ()
    layer_types = tuple(getattr(config, "layer_types", None) or [SLIDING] * config.num_hidden_layers)
    return (window, layer_types) if SLIDING in layer_types else (None, ())


def _nope_layers(config: transformers.PretrainedConfig) -> tuple[int, ...]:
    """The layers SmolLM3's ``no_rope_layers`` (one flag a layer, 1: the layer rotates) leave unrotated."""
    flags = getattr(config, "no_rope_layers", None) or ()
    if flags and len(flags) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, the model has {config.num_hidden_layers}")
    return tuple(layer for layer, rotates in enumerate(flags) if not rotates)


def _query_temperature(config: transformers.PretrainedConfig, architecture: str) -> tuple[float, int] | None:
    """Ministral 3's query scaling by position: ``(llama_4_scaling_beta, original context)`` from its
    rope parameters; None for other architectures or a beta of 0."""
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    if architecture != "Ministral3ForCausalLM" or not beta:
        return None
    period = params.get("original_max_position_embeddings")
    if not period:
        raise ValueError("llama_4_scaling_beta needs the rope parameters' original_max_position_embeddings")
    return float(beta), int(period)


def _rope(config: transformers.PretrainedConfig) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """``(theta, scaling, local theta, partial rotary factor)`` from transformers 5's
    ``rope_parameters`` (per layer type for Gemma 3) or 4's ``rope_theta``/``rope_scaling``;
    LongRoPE's and YaRN's parameters resolved as transformers resolves them."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    local_theta = None
    if FULL in params:  # one set of parameters per layer type
        local = dict(params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {local['rope_type']!r} on sliding layers")
        local_theta = local.get("rope_theta")
        params = dict(params[FULL])
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    # transformers 4 keeps these two on the config itself; 5 moves them into the rope parameters
    partial_rotary_factor = (params.pop("partial_rotary_factor", None)
                             or getattr(config, "partial_rotary_factor", None) or 1.0)
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if rope_type == "default":
        return theta, None, local_theta, partial_rotary_factor
    scaling = {**params, "rope_type": rope_type}
    if rope_type in ("longrope", "yarn") and not scaling.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = getattr(config, "original_max_position_embeddings", None)
        if not scaling["original_max_position_embeddings"]:
            raise ValueError(f"{rope_type} rope scaling needs original_max_position_embeddings")
    if rope_type == "longrope":
        scaling = _resolve_longrope(scaling, config.max_position_embeddings)
    elif rope_type == "yarn":
        scaling = _resolve_yarn(scaling, config.max_position_embeddings)
    return theta, scaling, local_theta, partial_rotary_factor


def _resolve_longrope(params: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """transformers' ``_compute_longrope_parameters`` inputs, resolved (``_resolve_factors``;
    the attention factor's default ``longrope_attention_factor``)."""
    original, _, attention_factor = _resolve_factors(params, max_positions, longrope_attention_factor)
    return {"rope_type": "longrope", "short_factor": tuple(params["short_factor"]),
            "long_factor": tuple(params["long_factor"]), "original_max_position_embeddings": original,
            "attention_factor": attention_factor}


def _resolve_yarn(params: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """transformers' ``_compute_yarn_parameters`` inputs, resolved (``_resolve_factors``; the
    attention factor's default YaRN's mscale, of ``mscale`` and ``mscale_all_dim`` when both are
    set), ``beta_fast``/``beta_slow`` defaulting to 32/1, ``truncate`` to True."""
    mscales = params.get("mscale"), params.get("mscale_all_dim")
    original, factor, attention_factor = _resolve_factors(params, max_positions,
                                                          lambda f, _: yarn_attention_factor(f, *mscales))
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True)), "attention_factor": attention_factor}


def _resolve_factors(params: dict[str, Any], max_positions: int,
                     default_attention_factor: Callable[[float, int], float]) -> tuple[int, float, float]:
    """``(original context, factor, attention factor)``: ``factor`` defaults to ``max_positions /
    original``, the attention factor to ``default_attention_factor(factor, original)``."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = default_attention_factor(factor, original)
    return original, factor, float(attention_factor)


def context_length(max_position_embeddings: int, scaling: dict[str, Any] | None, architecture: str) -> int:
    """The positions a model serves, as vLLM derives them: ``max_position_embeddings``, times linear
    scaling's ``factor`` (the context it was tuned to; but Gemma 3's is already the scaled one), or
    YaRN's ``factor`` times its original context when longer (Qwen's long-context configs keep the
    original in ``max_position_embeddings``)."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "linear" and architecture != "Gemma3ForCausalLM":
        return int(max_position_embeddings * scaling["factor"])
    if rope_type != "yarn":
        return max_position_embeddings
    return max(max_position_embeddings, int(scaling["factor"] * scaling["original_max_position_embeddings"]))


def _as_tuple(token_ids: int | list[int] | None) -> tuple[int, ...]:
    if token_ids is None:
        return ()
    return (token_ids,) if isinstance(token_ids, int) else tuple(token_ids)
