"""The CUDA backend's tests run on the GPU where there is one, else on CPU tensors under Triton's
interpreter, which must be switched on before any kernel is decorated (and stay on while they
run). Every test here is marked ``cuda``: ``pytest -m cuda`` on a GPU machine runs them there."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _index_one_element_blocks() -> None:
    """Let the interpreter of Triton before 3.7 (3.6 is the GPU machine's) take a loop bound
    computed from a program id or a load: it converts the bound's numpy data with ``int()``, which
    refuses the one-element arrays those give, where later versions squeeze them first. Changes
    nothing where the interpreter squeezes already, or is off."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(patch_tensor):
        return

    def patch_with_index(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_with_index


if DEVICE == "cpu":
    _index_one_element_blocks()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
