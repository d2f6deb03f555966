"""The CUDA backend's tests run on the GPU where there is one, else on CPU tensors under Triton's
interpreter, which must be switched on before any kernel is decorated (and stay on while they
run). Every test here is marked ``cuda``: ``pytest -m cuda`` on a GPU machine runs them there."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
