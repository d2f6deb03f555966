"""Multimodal checkpoints served for their text, as vLLM serves them without images: Gemma 3's
``Gemma3ForConditionalGeneration`` (gemma-3-4b, 12b and 27b) and Mistral 3's
``Mistral3ForConditionalGeneration`` (Mistral-Small-3.1/3.2-24B, whose language model is a
``MistralForCausalLM``; Ministral 3, a ``Ministral3ForCausalLM``). Their language model is an
ordinary causal LM under the wrapper's config and tensor names (both wrappers share transformers'
llava naming); the vision tower and the projector are never read. Requests with images are
refused by the server's protocol (text content parts only)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import transformers

# model_type -> architecture of the multimodal wrappers whose text model vivace serves.
MULTIMODAL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}
# Checkpoint prefix -> the text model's. Transformers before 4.52 saved the language model under
# ``language_model.`` (and 5 writes those names back); 4.52 to 4.57 under ``model.language_model.``.
_TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                  "model.language_model.": "model."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def multimodal_architecture(config: dict[str, Any]) -> str | None:
    """The architecture of the ``config.json`` dict ``config`` when it is a multimodal wrapper of
    ``MULTIMODAL_TYPES``, else None."""
    architecture = (config.get("architectures") or [MULTIMODAL_TYPES.get(config.get("model_type") or "")])[0]
    return architecture if architecture in MULTIMODAL_TYPES.values() else None


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """``config`` itself, or for a multimodal wrapper a copy of its ``text_config`` with what the
    wrapper decides for the text model in transformers: ``tie_word_embeddings`` (the LM head is
    the wrapper's), ``eos_token_id`` where the wrapper sets it (gemma-3-4b-it: ``[1, 106]``), and
    no final logit soft-capping (``Gemma3ForConditionalGeneration`` never applies it)."""
    if config.model_type not in MULTIMODAL_TYPES:
        return config
    text = copy.deepcopy(config.get_text_config())
    text.tie_word_embeddings = config.tie_word_embeddings
    if getattr(config, "eos_token_id", None) is not None:
        text.eos_token_id = config.eos_token_id
    text.final_logit_softcapping = None
    return text


def ties_embeddings(tied: bool, tensor_names: Iterable[str]) -> bool:
    """Whether the text model's LM head is its token embedding, for a wrapper whose config says
    ``tied`` and whose checkpoint holds ``tensor_names``: as transformers 5 loads it, tied unless
    the checkpoint has an LM head of its own. (Mistral 3's config defaults to tied in transformers
    5, while Mistral-Small's checkpoints carry ``language_model.lm_head.weight``.)"""
    return tied and "lm_head.weight" not in {text_tensor_name(name) for name in tensor_names}


def text_tensor_name(name: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor ``name``: None for the vision
    tower's and the projector's, ``name`` unchanged for one of no known prefix (for the loader to
    report as unexpected)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    return name if prefix is None else _TEXT_PREFIXES[prefix] + name.removeprefix(prefix)
