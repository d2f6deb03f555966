"""One tiny model per kind per session, with its Hugging Face directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers

from .tiny import save_hf_dir, tiny_model


@dataclass(frozen=True)
class TinyModel:
    hf: transformers.PreTrainedModel
    path: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """``tiny(kind)``: the random HF model of that kind and the directory it is saved in."""
    cache: dict[str, TinyModel] = {}

    def get(kind: str) -> TinyModel:
        if kind not in cache:
            model = tiny_model(kind)
            cache[kind] = TinyModel(model, save_hf_dir(model, tmp_path_factory.mktemp(kind)))
        return cache[kind]

    return get
