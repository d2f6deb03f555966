"""The sampling defaults a model's creator recommends (vLLM's ``--generation-config``): read from a
Hugging Face ``generation_config.json``, or from a GGUF's ``general.sampling.*`` keys (llama.cpp's),
under the request field names they stand for, with ``--override-generation-config`` on top."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vivace.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vivace.config import EngineConfig

GENERATION_CONFIG_FILE = "generation_config.json"
# --generation-config's words: the model's own file ("auto") or none ("vllm"); else a folder.
AUTO, NONE = "auto", "vllm"
# The fields vLLM takes from a generation config, and the request field each one is the default of.
HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_INTEGRAL = ("top_k", "max_tokens")


def check_generation_config(choice: str) -> None:
    """Raise ValueError naming the flag unless ``choice`` is "auto", "vllm" or a folder holding a
    generation_config.json."""
    if choice in (AUTO, NONE):
        return
    if not (Path(choice).expanduser() / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"--generation-config {choice}: no {GENERATION_CONFIG_FILE} there (give auto, "
                         f"vllm, or a folder holding one)")


def check_override(override: Mapping[str, Any]) -> dict[str, float | int]:
    """``--override-generation-config``'s fields (a generation config's names), checked: a number each
    (an integer for top_k and max_new_tokens). Raises ValueError naming the flag."""
    return _sampling_fields(override, HF_FIELDS, "--override-generation-config", strict=True)


def sampling_defaults(choice: str, model_source: Path, override: Mapping[str, Any]) -> dict[str, float | int]:
    """The request defaults a model served from ``model_source`` gets (request field names:
    ``max_new_tokens`` is ``max_tokens``): those of ``choice`` ("auto": the model's own, "vllm":
    none, else a folder's generation_config.json), then ``override``'s on top. Raises ValueError
    for a file that is not a JSON object or a field that is not a number."""
    if choice == NONE:
        found: dict[str, float | int] = {}
    elif choice == AUTO:
        found = model_recommendations(model_source)
    else:
        found = _read_hf_file(Path(choice).expanduser() / GENERATION_CONFIG_FILE)
    return {**found, **check_override(override)}


def model_recommendations(source: Path) -> dict[str, float | int]:
    """What the model at ``source`` recommends: its folder's generation_config.json, or its GGUF
    file's ``general.sampling.*`` keys; nothing when it has neither."""
    if source.is_dir():
        file = source / GENERATION_CONFIG_FILE
        return _read_hf_file(file) if file.is_file() else {}
    if source.suffix == ".gguf" and source.is_file():
        from vivace.models.gguf_file import GGUFFile  # the engine has loaded vivace.models by now

        metadata = GGUFFile(source).metadata
        return _sampling_fields({key: metadata[key] for key in GGUF_KEYS if key in metadata}, GGUF_KEYS,
                                str(source))
    return {}


def _read_hf_file(file: Path) -> dict[str, float | int]:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return _sampling_fields(raw, HF_FIELDS, str(file))


def _sampling_fields(raw: Mapping[str, Any], names: Mapping[str, str], where: str,
                     strict: bool = False) -> dict[str, float | int]:
    """``raw``'s fields among ``names`` (null ones left out) under their request names. Other keys
    are a generation config's own business (eos_token_id, do_sample...), unless ``strict``."""
    unknown = [key for key in raw if key not in names]
    if strict and unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (use {', '.join(names)})")
    fields: dict[str, float | int] = {}
    for key, value in raw.items():
        if key not in names or value is None:
            continue
        name = names[key]
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not isinstance(value, int | float) or (name in _INTEGRAL and not integral):
            kind = "an integer" if name in _INTEGRAL else "a number"
            raise ValueError(f"{where}: {key} must be {kind}, got {value!r}")
        fields[name] = int(value) if name in _INTEGRAL else float(value)
    return fields


def check_sampling_defaults(defaults: Mapping[str, float | int], source: str) -> None:
    """Raise ValueError naming ``source`` when a request given ``defaults`` would be refused: a
    value SamplingParams rejects, or max_tokens below 1."""
    try:
        SamplingParams(**defaults)
        if defaults.get("max_tokens", 1) < 1:
            raise ValueError("max_new_tokens must be >= 1")
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def served_defaults(config: EngineConfig, model_source: Path) -> dict[str, float | int]:
    """The sampling defaults ``config`` gives requests to the model loaded from ``model_source``
    (``sampling_defaults``), checked (ValueError naming the flag) and
    logged when there are any."""
    defaults = sampling_defaults(config.generation_config, model_source, config.override_generation_config)
    check_sampling_defaults(defaults, f"--generation-config {config.generation_config}")
    if defaults:
        source = "--override-generation-config" if config.generation_config == "vllm" else \
            f"the model's generation config ({config.generation_config})"
        logging.getLogger(__name__).info(
            "vivace: default sampling parameters from %s, for requests that leave them out: %s "
            "(--generation-config vllm turns this off)", source,
            ", ".join(f"{name}={value}" for name, value in defaults.items()))
    return defaults
